"""The driver: a job's workers from start to close, and where a job starts.

    job = Job(cfg)            # refuses a bad config or schedule before any process starts (train/preflight.py)
    with job:                 # start (or join, under torchrun) the workers; kill them all on any error
        job.start()
        results = job.step(0)

`run_job` starts a job and runs the training loop on it (train/loop.py: one control message per call of one
step or more; checkpoints, evaluation and profiling hook in between steps, where the loop says so).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pipegpt.state import checkpoint, snapshot
from pipegpt.state.rng import grid_change_line
from pipegpt.comm.rpc import ClusterJob, LocalCluster, TorchrunCluster, WorkerFailure, WorkerStalled, port_is_free
from pipegpt.config import COMPILE_STEPS, ConfigError, TrainConfig
from pipegpt.engine.placement import (bind_this_process, default_threads, resolve_device, torchrun_cores,
                                      under_torchrun, worker_cores)
from pipegpt.observe.metrics import RunLog, StepMetrics
from pipegpt.observe.clocks import measure_offsets, shift_events
from pipegpt.engine.results import WorkerStep
from pipegpt.planner.run_plan import evaluation_plan, synthesis_line
from pipegpt.schedule import schedule_spec
from pipegpt.resilience.watchdog import STALL_FACTOR, STALL_FLOOR_S, WHERE_TIMEOUT_S, find_culprit, format_table, stall_threshold
from pipegpt.train.loop import NonFiniteError, train, warn
from pipegpt.train.preflight import check, check_host_memory, hellaswag_rows, start_from
from pipegpt.train.worker import Worker


def resumed_step(cfg: TrainConfig) -> int:
    """The step --resume's checkpoint was taken after, where this attempt starts (0 without --resume), known
    before any worker starts: a resume with nothing left to do writes nothing."""
    if cfg.checkpoint.resume is None:
        return 0
    try:
        return int(checkpoint.read_manifest(checkpoint.resolve(cfg.checkpoint.resume), verify=False)["step"])
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None


def learning_rate_jump(cfg: TrainConfig) -> str | None:
    """A line when a resume's --steps moves the learning-rate schedule under it (the cosine decays over --steps):
    the rate at the resumed step under the run's old length and under the new, when they differ by over 1%."""
    from pipegpt.train.optim import lr_at

    if cfg.checkpoint.resume is None:
        return None
    manifest = checkpoint.read_manifest(checkpoint.resolve(cfg.checkpoint.resume), verify=False)
    old_steps = (manifest.get("config") or {}).get("runtime", {}).get("steps")
    step = int(manifest["step"])
    if not old_steps or old_steps == cfg.runtime.steps:
        return None
    before, after = lr_at(step, cfg.optim, old_steps), lr_at(step, cfg.optim, cfg.runtime.steps)
    if abs(after - before) <= 0.01 * max(abs(before), 1e-12):
        return None
    return (f"pipegpt: --steps {old_steps} -> {cfg.runtime.steps} moves the {cfg.optim.lr_schedule} learning-rate "
            f"schedule: step {step + 1} runs at lr {after:.3g}, not the {before:.3g} the run was heading for")



class Job(ClusterJob):
    """A job's workers, from start to close: one actor per rank, steered over RPC."""

    def __init__(self, cfg: TrainConfig, port: int | None = None, threads_per_worker: int | None = None):
        self.cfg, self.plan = cfg, check(cfg)
        if resolve_device(cfg.runtime.device, cfg.world_size) == "cpu":  # this machine's, not the config's limit
            check_host_memory(cfg, self.plan)
        self.eval_plan = evaluation_plan(self.plan)
        if port is not None and not under_torchrun() and not port_is_free(port):
            raise ConfigError(f"port {port} is in use: choose a free port or leave --port out")
        self.port = port
        self.threads = threads_per_worker or cfg.runtime.threads_per_worker or default_threads(cfg.world_size)
        # --bind-cores: each local worker's cores, checked here so too few cores is one line before any start
        self.cores = None
        if cfg.runtime.bind_cores:
            self.cores = [torchrun_cores(cfg.runtime.threads_per_worker)] if under_torchrun() else \
                [worker_cores(r, cfg.world_size, self.threads) for r in range(cfg.world_size)]
        self.cluster = None
        self.first_step = 0  # where training starts: 0, or the step a resumed checkpoint was taken after
        self.loaded = None  # (checkpoint, seconds to load it) once started from one
        self.step_times: list[float] = []  # seconds, of this job's steps so far: the stall watchdog's reference
        self.clock_offsets: list[float] = []  # per rank, seconds that put its trace events on this process's clock
        self.say: Callable[[str], None] = lambda line: print(line, flush=True)  # the driver's notes (--balance cost)
        self.current_step: int | None = None  # the loop's index (from 0) of the step running or last run
        self.current_count = 1  # steps in the call that runs it (--steps-per-call): a failure is inside those
        self.failed_at: float | None = None  # time.time() of the failure this attempt restarts after (--max-restarts)
        self.steps_lost: int | None = None  # the steps completed before that failure that this attempt does again
        self.hellaswag_data = hellaswag_rows(cfg)  # tokenized once, checked before any worker starts

    def start(self) -> bool:
        """Start the workers and build them for the plan. Under torchrun every process calls this; the
        ones other than the driver serve until the driver shuts the job down, then return False."""
        cfg = self.cfg
        if under_torchrun():
            if self.cores:  # before the RPC agent and gloo start their threads
                bind_this_process(self.cores[0])
            self.cluster = TorchrunCluster(cfg.runtime.timeout_s)
            init_method = self.cluster.init_method
            if not self.cluster.is_driver:
                self.cluster.close()  # serve the driver's requests until it shuts everyone down
                self.cluster = None  # done: nothing left to close or kill here
                return False
        else:
            self.cluster = LocalCluster(cfg.world_size, cfg.runtime.timeout_s, self.threads, group_port=self.port,
                                        cores=self.cores)
            init_method = self.cluster.group_init_method
        self.cluster.spawn(Worker, lambda r: (r, cfg, init_method))
        described = self.cluster.call("start", self.plan, self.eval_plan)  # all built before step 0's clock starts
        if cfg.runtime.bind_cores:  # what each worker's process reports, not what was asked of it
            self.say("pipegpt: cores per rank (--bind-cores): "
                     + "; ".join(f"{d['rank']}: {','.join(map(str, d['cores'] or ['?']))}" for d in described))
        # Workers on other machines count perf_counter from their own boot: map each onto this one's.
        self.clock_offsets = measure_offsets(lambda r: self.cluster.call("clock", ranks=[r])[0],
                                             range(self.cluster.world_size))
        self.measure_and_fit()
        source = start_from(cfg)
        if source is not None:
            t0 = time.perf_counter()
            steps = self.cluster.call("load", str(source), cfg.checkpoint.resume is None)
            self.first_step, self.loaded = steps[0], (source, time.perf_counter() - t0)
            if cfg.checkpoint.resume:
                warn(grid_change_line(checkpoint.read_manifest(source, verify=False), cfg.parallel.dims,
                                       cfg.model.dropout))
        return True

    def measure_and_fit(self) -> None:
        """--balance cost and --schedule auto/auto-v, on started workers before step 0: rank 0 measures the
        embedding, one block of each layer kind and the head with its loss on its device (forward + backward of a
        microbatch of the run's shape). --balance cost then picks the split that makes the busiest rank's work the
        least for the plan's placement (balance_layers, each layer costing its kind's: per_layer_costs); auto
        writes the order for those stages' costs (the split first, then the order). Every worker is rebuilt for it
        (Job.build: the same grid, the same initial weights, which come from per-name seeds). The job's config then
        holds the split, the order's costs and what they came from (config.json records them)."""
        from pipegpt.costs.balance import balance_layers, per_layer_costs

        p = self.cfg.parallel
        balance = p.balance == "cost" and p.balanced_costs is None
        order = p.schedule_file is None and schedule_spec(p.schedule).synthesized and p.schedule_costs is None
        if not (balance or order):
            return
        costs = self.cluster.call("measure_layer_costs", ranks=[0])[0]
        measured = (costs["embed"], costs["block"], costs["head"])
        split = tuple(x for piece in ("embed", "block", "head")
                      for x in (costs[f"{piece}_forward"], costs[piece] - costs[f"{piece}_forward"],
                                costs[f"{piece}_weight"]))
        changes = {"schedule_costs": split} if order else {}
        if balance:
            embed, block, head = measured
            layers = balance_layers(per_layer_costs(self.cfg.model, costs), embed, head, self.plan.stage_to_rank)
            changes.update(layers_per_stage=tuple(layers), balanced_costs=measured)
        self.build(self.cfg.replace(**changes))
        embed, block, head = measured
        said = f"(costs: embed {embed * 1e3:.2f} ms, block {block * 1e3:.2f} ms, head {head * 1e3:.2f} ms)"
        if balance:
            self.say(f"pipegpt: balanced layers per stage {','.join(map(str, self.cfg.parallel.layers_per_stage))} "
                     f"{said}")
        if order:
            self.say(synthesis_line(self.plan) + ("" if balance else f" {said}"))

    def save(self, root: Path, step: int) -> Path:
        """A checkpoint after `step` steps under root: every rank writes its part, then the atomic commit."""
        cfg = self.cfg
        tmp = checkpoint.begin(root, step)
        saved = self.cluster.call("save", str(tmp), step)
        bad = next((s for s in saved if s.nonfinite), None)
        if bad is not None:  # never a checkpoint of non-finite values: it would push out the finite ones (--keep)
            shutil.rmtree(tmp, ignore_errors=True)
            raise NonFiniteError(f"step {step}: {bad.nonfinite[1]} is not finite on rank {bad.rank} "
                                 f"(stage {bad.nonfinite[0]}); no checkpoint written")
        return checkpoint.commit(tmp, self._manifest(step), cfg.checkpoint.keep, {s.name: s.sha256 for s in saved})

    def _manifest(self, step: int) -> dict:
        cfg = self.cfg
        return {"step": step, "model": cfg.model.settings(), "tokenizer": cfg.data.tokenizer, "world_size": cfg.world_size,
                "config": asdict(cfg), "optimizer": True, "plan": self.plan.name}

    def snapshot(self, run_dir: Path, step: int) -> None:
        """--snapshot-every: every rank copies its state after `step` steps and writes it in the background into
        the run's snapshot directory in shared memory (pipegpt.state.snapshot); returns once every copy is made."""
        manifest = {**self._manifest(step), "run_dir": str(Path(run_dir).resolve())}  # where a restart goes on
        directory = snapshot.begin(snapshot.claim_root(run_dir), step, manifest)  # this driver's, never another's
        self.cluster.call("snapshot", str(directory))

    def step(self, step: int) -> list[WorkerStep]:
        """One step on every rank, watched: one that runs far longer than the steps before it ends the job,
        naming the rank that holds the others up (pipegpt.resilience.watchdog), well before the communication timeout."""
        return self.steps(step, 1)[0][0]

    def steps(self, first: int, count: int) -> list[tuple[list[WorkerStep], float]]:
        """Steps first .. first + count - 1 on every rank, in one call when count > 1 (--steps-per-call): per step,
        every rank's answer and the seconds it is counted (a call's time shared out in proportion to the slowest
        rank's time in each step). Watched as one step is, with count steps' threshold and deadline. Fewer come
        back when a step's update was dropped and the run stops there (--on-nonfinite stop)."""
        threshold = stall_threshold([t * count for t in self.step_times])
        t0 = time.perf_counter()
        self.current_step, self.current_count = first, count
        cold = len(self.step_times) < COMPILE_STEPS  # these may warm up, or compile (--compile)
        watch = dict(timeout_s=count * self.cfg.runtime.step_deadline_s(cold), limit_flag="--step-timeout",
                     stall_after_s=threshold, on_stall=lambda waited: self._stalled(first, waited, threshold, count))
        if count == 1:
            per_rank = [[answer] for answer in self.cluster.call("step", first, **watch)]
        else:
            per_rank = self.cluster.call("steps", first, count, self.cfg.optim.on_nonfinite == "stop", **watch)
        elapsed = time.perf_counter() - t0
        if len({len(answers) for answers in per_rank}) != 1:  # they decide alike: a rank that did not is a bug
            raise RuntimeError(f"steps {first + 1}.. came back uneven: {[len(a) for a in per_rank]} steps per rank")
        per_step = [list(answers) for answers in zip(*per_rank)]
        slowest = [max((r.compute_s or 0.0) for r in results) for results in per_step]
        total = sum(slowest)
        times = [elapsed * t / total if total > 0 else elapsed / len(per_step) for t in slowest]
        self.step_times.extend(times)
        for results in per_step:
            for r in results:
                offset = self.clock_offsets[r.rank]
                if offset:  # one machine's ranks share this process's clock
                    r.events, r.phases = shift_events(r.events, offset), shift_events(r.phases, offset)
        return list(zip(per_step, times))

    def _stalled(self, step: int, waited_s: float, threshold_s: float, count: int = 1) -> None:
        """Ask every rank where it is and raise naming the culprit, with the table as the report."""
        answers = self.cluster.ask("where", timeout_s=WHERE_TIMEOUT_S)
        rows = [answers.get(r, {"rank": r}) for r in range(self.cluster.world_size)]
        # in a call of several steps, the earliest step a rank is inside is the one that stalled
        step = min((row["step"] for row in rows if row.get("now") and row.get("step") is not None), default=step)
        # A rank's GPU position, where it reports one (CUDA: its host may be far ahead), is where it really is.
        at = {row["rank"]: row.get("device") or row["now"] for row in rows if row.get("now")}
        # a rank that did not answer waits for nobody: a sink
        waits = {row["rank"]: (row["now"] and at[row["rank"]][2]) if "now" in row else () for row in rows}
        doing = {r: now[1] for r, now in at.items()}
        culprit = find_culprit(waits, doing, {row["rank"]: row["now"][1] for row in rows if row.get("device")})
        if culprit is None:
            return  # every rank is between steps: their answers to step() are on their way
        per_call = f" x {count} steps a call" if count > 1 else ""
        report = "\n".join([f"step {step + 1} stalled: running for {waited_s:.1f}s, past {threshold_s:.1f}s "
                            f"(max({STALL_FACTOR:g} x the recent median step{per_call}, {STALL_FLOOR_S:g}s)); "
                            f"where each rank is:", *format_table(rows)])
        if culprit.rank not in answers:
            raise WorkerFailure(culprit.rank, f"stopped answering (no answer to where() within "
                                              f"{WHERE_TIMEOUT_S:.0f}s once step {step + 1} stalled)", report)
        raise WorkerStalled(culprit.rank, f"{culprit.cause} (step {step + 1}, {waited_s:.0f}s)", report)

    def build(self, cfg: TrainConfig) -> list[dict]:
        """Rebuild every worker for another config on the same grid (dp x pp x cp x tp)."""
        if cfg.parallel.dims != self.cfg.parallel.dims:
            raise ConfigError(f"a running job keeps its grid {self.cfg.parallel.dims}, not {cfg.parallel.dims}")
        self.cfg, self.plan = cfg, check(cfg)
        self.step_times = []  # another config, other step times
        self.eval_plan = evaluation_plan(self.plan)
        self.hellaswag_data = hellaswag_rows(cfg, self.hellaswag_data)
        return self.cluster.call("build", cfg, self.plan, self.eval_plan)

    def hellaswag(self) -> tuple[float, float]:
        """(acc, acc_norm) of the current model on --hellaswag's examples, scored on the workers in the run's
        layout (pipegpt.data.hellaswag.score_on_engine): only per-candidate loss sums come back."""
        from pipegpt.data.hellaswag import combine_scores, count_correct

        _, examples, rendered = self.hellaswag_data
        p = self.cfg.parallel
        steps = -(-len(rendered) // (self.eval_plan.num_microbatches * p.dp))  # each as long as a wait may be
        scores = combine_scores(self.cluster.call("hellaswag", rendered,
                                                  timeout_s=self.cfg.runtime.wait_timeout_s * (steps + 1)))
        correct, correct_norm = count_correct(examples, scores)
        return correct / len(examples), correct_norm / len(examples)

    def evaluate(self) -> float:
        """Validation loss: the mean over the eval batches' microbatches (the last stage's ranks report them)."""
        # several batches, unwatched; the first evaluation compiles its forward-only graphs under --compile
        losses = [loss for r in self.cluster.call("evaluate", self.cfg.eval.eval_batches, limit_flag="--step-timeout",
                                                  timeout_s=self.cfg.runtime.step_deadline_s(first=True))
                  for loss in r["losses"]]
        return sum(losses) / len(losses)

    def call(self, method: str, *args) -> list:
        return self.cluster.call(method, *args)


def run_job(job: Job, run_dir: Path, on_step: Callable[[StepMetrics], None] = lambda m: None
            ) -> list[StepMetrics] | None:
    """Start (or join, under torchrun) the job's workers, train, and write metrics and the last step's trace.

    Returns the step metrics on the driver, None on the other torchrun ranks.
    """
    with job:
        if not job.start():
            return None
        log = RunLog(run_dir, job.cfg, job.plan, job.first_step)
        stopped, wrote = None, True
        try:
            history = train(job, log, on_step)
        except NonFiniteError as e:
            stopped = e  # every rank ended the step without applying it: close the job as usual, then say why
        except OSError:
            wrote = False  # a run file (metrics.jsonl, a manifest, ...) could not be written: the job is killed
            raise
        finally:
            log.close(plot=wrote)
        job.close()
    if stopped is not None:
        raise stopped
    return history

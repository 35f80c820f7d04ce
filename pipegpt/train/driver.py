"""The driver: checks a job, builds its plan once, owns the workers' lives and runs the training loop.

    job = Job(cfg)            # refuses a bad config or schedule before any process starts
    with job:                 # start (or join, under torchrun) the workers; kill them all on any error
        job.start()
        results = job.step(0)

`train()` is the loop: one control message per step; checkpoints, evaluation and profiling hook in
between steps, where the loop says so.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pipegpt.state import checkpoint, snapshot
from pipegpt.state.rng import grid_change_line
from pipegpt.comm.rpc import ClusterJob, LocalCluster, TorchrunCluster, WorkerFailure, WorkerStalled, port_is_free
from pipegpt.config import COMPILE_STEPS, ConfigError, TrainConfig
from pipegpt.engine.placement import (bind_this_process, local_world_size, resolve_device, torchrun_cores,
                                     under_torchrun, worker_cores)
from pipegpt.observe.metrics import RunLog, StepMetrics, step_metrics
from pipegpt.observe.profile import problem_line
from pipegpt.observe.clocks import measure_offsets, shift_events
from pipegpt.engine.results import WorkerStep
from pipegpt.model.partition import partition_layers
from pipegpt.planner.run_plan import check_layers_fill, evaluation_plan, make_plan, synthesis_line
from pipegpt.schedule import Plan, schedule_spec
from pipegpt.resilience.faults import check_faults
from pipegpt.resilience.watchdog import STALL_FACTOR, STALL_FLOOR_S, WHERE_TIMEOUT_S, find_culprit, format_table, stall_threshold
from pipegpt.train.worker import Worker
from pipegpt import run_files


def check(cfg: TrainConfig) -> Plan:
    """Everything that can be refused before a worker starts; returns the plan."""
    import torch

    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.data.tokens import builtin_tokens, open_tokens

    cfg.validate(os.environ)
    try:
        check_faults(cfg.world_size, cfg.runtime.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.data is not None:  # headers, sizes, token ids below the vocabulary, enough tokens, the tokenizer
        m = cfg.model
        open_tokens(cfg.data.data, "train", vocab_size=m.vocab_size, seq_len=m.seq_len, tokenizer=cfg.data.tokenizer)
        open_tokens(cfg.data.data, "val", vocab_size=m.vocab_size, tokenizer=cfg.data.tokenizer)
    else:  # the built-in corpus is tokenized by each worker: gpt2 offline fails here, in one line
        top = int(builtin_tokens(get_tokenizer(cfg.data.tokenizer)).max())
        if top >= cfg.model.vocab_size:
            raise ConfigError(f"the built-in corpus holds token id {top} (tokenizer {cfg.data.tokenizer}), not below "
                              f"vocab_size={cfg.model.vocab_size}: give --vocab-size {top + 1} or more")
    if cfg.data.document_mask and get_tokenizer(cfg.data.tokenizer).eot_token is None:
        raise ConfigError(f"--document-mask finds documents by the end-of-text token, and tokenizer "
                          f"{cfg.data.tokenizer} has none: use one with <|endoftext|>, <|end_of_text|> or </s>")
    start_from(cfg)
    if cfg.eval.hellaswag:
        from pipegpt.data.hellaswag import read_examples

        if not cfg.eval.eval_every:
            raise ConfigError("--hellaswag scores the model at evaluation steps: give --eval-every N too")
        read_examples(cfg.eval.hellaswag)  # a bad file is refused before any worker starts
    plan = make_plan(cfg)
    check_layers_fill(cfg, plan)
    partition_layers(cfg.model.n_layer, plan.num_stages, cfg.parallel.layers_per_stage)
    if resolve_device(cfg.runtime.device, cfg.world_size) == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = local_world_size(cfg.world_size)
        if have < local:
            raise ConfigError(f"device=cuda needs one GPU per rank on this machine ({local}), "
                              f"but {have} are visible: use --device cpu or fewer ranks")
    return plan


PROCESS_BYTES = 400 * 2**20  # a worker's own footprint before its model: the interpreter, torch, gloo, RPC


def _check_host_memory(cfg: TrainConfig, plan: Plan, meminfo: str = "/proc/meminfo") -> None:
    """On CPU, the planner's estimate of what this machine's ranks hold (weights, gradients, optimizer state,
    activations, message buffers; pipegpt.costs.memory) against the memory it has available: a job larger than
    the machine is one line now, not a worker killed by the kernel a minute or two later."""
    from pipegpt.costs.activations import memory_precision
    from pipegpt.costs.memory import plan_memory

    try:
        with open(meminfo) as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return  # not Linux: nothing to compare with
    p, m = cfg.parallel, cfg.model
    ranks = plan_memory(m, plan, partition_layers(m.n_layer, plan.num_stages, p.layers_per_stage),
                        microbatch_size=p.microbatch_size, sharding=p.sharding, recompute=p.recompute,
                        precision=memory_precision(cfg.runtime.precision, cfg.runtime.dtype), device="cpu")
    local = local_world_size(cfg.world_size)
    per_replica = sum(r.total for r in ranks) * p.tp * p.cp  # every tp and cp rank of a pipeline rank holds as much
    need = (per_replica * p.dp if local == cfg.world_size else max(r.total for r in ranks) * local) \
        + PROCESS_BYTES * local
    if need > available:
        raise ConfigError(f"this job needs about {need / 2**30:.1f} GiB of host memory on this machine ({local} "
                          f"rank{'s' * (local > 1)}: weights, gradients, optimizer state, activations), and "
                          f"{available / 2**30:.1f} GiB is available: use a smaller model (--model, --n-layer), "
                          f"fewer ranks here, or more machines")


def start_from(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume or --init-from names, checked whole and of this model's shape (None: neither)."""
    path = cfg.checkpoint.resume or cfg.checkpoint.init_from
    if path is None:
        return None
    try:
        found = checkpoint.resolve(path)
        manifest = checkpoint.read_manifest(found)
        checkpoint.check_compatible(manifest, asdict(cfg.model), found)
        checkpoint.check_tensors(found, cfg.model)
        if cfg.checkpoint.resume and not manifest.get("optimizer", True):
            raise checkpoint.CheckpointError(f"{found}: holds weights only (no optimizer state, no step): "
                                             f"start from it with --init-from")
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None
    return found


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


def _hellaswag_rows(cfg: TrainConfig, had: tuple | None = None) -> tuple:
    """(what they depend on, --hellaswag's examples, their candidates' tokens): a token id the model cannot take
    is refused now. `had`: an earlier answer, kept when it still holds."""
    key = (cfg.eval.hellaswag, cfg.data.tokenizer, cfg.model.seq_len, cfg.model.vocab_size)
    if had is not None and had[0] == key:
        return had
    if not cfg.eval.hellaswag:
        return key, None, None
    from pipegpt.data.hellaswag import read_examples, render_all

    examples = read_examples(cfg.eval.hellaswag)
    return key, examples, render_all(examples, *key[1:], cfg.eval.hellaswag)


class Job(ClusterJob):
    """A job's workers, from start to close: one actor per rank, steered over RPC."""

    def __init__(self, cfg: TrainConfig, port: int | None = None, threads_per_worker: int | None = None):
        self.cfg, self.plan = cfg, check(cfg)
        if resolve_device(cfg.runtime.device, cfg.world_size) == "cpu":  # this machine's, not the config's limit
            _check_host_memory(cfg, self.plan)
        self.eval_plan = evaluation_plan(self.plan)
        if port is not None and not under_torchrun() and not port_is_free(port):
            raise ConfigError(f"port {port} is in use: choose a free port or leave --port out")
        self.port = port
        self.threads = threads_per_worker or cfg.runtime.threads_per_worker \
            or max(1, (os.cpu_count() or 1) // cfg.world_size)
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
        self.hellaswag_data = _hellaswag_rows(cfg)  # tokenized once, checked before any worker starts

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
                _warn(grid_change_line(checkpoint.read_manifest(source, verify=False), cfg.parallel.dims,
                                       cfg.model.dropout))
        return True

    def measure_and_fit(self) -> None:
        """--balance cost and --schedule auto/auto-v, on started workers before step 0: rank 0 measures the
        embedding, one block and the head with its loss on its device (forward + backward of a microbatch of the
        run's shape). --balance cost then picks the split that makes the busiest rank's work the least for the
        plan's placement (balance_layers); auto writes the order for those stages' costs (the split first, then
        the order). Every worker is rebuilt for it (Job.build: the same grid, the same initial weights, which
        come from per-name seeds). The job's config then holds the split, the order's costs and what they came
        from (config.json records them)."""
        from pipegpt.costs.balance import balance_layers

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
            layers = balance_layers([block] * self.cfg.model.n_layer, embed, head, self.plan.stage_to_rank)
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
        return {"step": step, "model": asdict(cfg.model), "tokenizer": cfg.data.tokenizer, "world_size": cfg.world_size,
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
                r.events = shift_events(r.events, self.clock_offsets[r.rank])
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
        self.hellaswag_data = _hellaswag_rows(cfg, self.hellaswag_data)
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


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is saved after `step`: every --save-every steps, and after the last."""
    return _every(cfg.checkpoint.save_every, step, cfg.runtime.steps)


def snapshot_due(cfg: TrainConfig, step: int) -> bool:
    """Whether the state after `step` is snapshotted: every --snapshot-every steps, but not the last step's."""
    every = cfg.checkpoint.snapshot_every
    return bool(every) and (step + 1) % every == 0 and step < cfg.runtime.steps - 1


def evaluation_due(cfg: TrainConfig, step: int) -> bool:
    """Whether the model is evaluated after `step`: every --eval-every steps, and after the last."""
    return _every(cfg.eval.eval_every, step, cfg.runtime.steps)


def _every(every: int | None, step: int, steps: int) -> bool:
    return bool(every) and ((step + 1) % every == 0 or step == steps - 1)


def profiled_steps(cfg: TrainConfig, first_step: int) -> range:
    """The steps --profile samples: from the first traced step this run takes to the last (empty: none)."""
    traced = sorted(s for s in cfg.runtime.traced_steps() if s >= first_step) if cfg.runtime.profile else []
    return range(traced[0], traced[-1] + 1) if traced else range(0)


def call_length(cfg: TrainConfig, step: int, profiled: range, most: int) -> int:
    """How many steps, from `step`, the driver's next call runs: up to `most` (--steps-per-call), ending with
    the first step after which the driver has work (an evaluation, a checkpoint, a snapshot, a profile to start
    or stop) and with the run's last step."""
    for count in range(1, most + 1):
        s = step + count - 1
        if s >= cfg.runtime.steps - 1 or evaluation_due(cfg, s) or checkpoint_due(cfg, s) or snapshot_due(cfg, s) \
                or (profiled and (s == profiled[-1] or s + 1 == profiled[0])):
            return count
    return most


@contextmanager
def profiling(job: Job, profiled: range, steps: range, directory: Path):
    """Around one call's steps: py-spy starts on every worker before the first profiled step and stops after the
    last (call_length makes them a call's first and last). Not stopped when the call raises: the job is then
    killed, workers and their py-spy children with it."""
    if profiled and profiled[0] in steps:
        _warn(problem_line(job.call("profile_start", str(directory.resolve())), "the run goes on without profiles"))
    yield
    if profiled and profiled[-1] in steps:
        stopped = job.cluster.call("profile_stop", timeout_s=job.cfg.runtime.timeout_s + 60)
        _warn(problem_line([problem for _, problem in stopped], "no profile from it"))


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient norm or saved value stopped the run before it was applied or saved (one line)."""


def nonfinite_cause(results: list[WorkerStep], last_stage: int) -> str:
    """Where a step's non-finite values appeared first: the loss (on the last stage's ranks), else the gradients
    of the latest stage, since the backward runs from the last stage to the first."""
    for r in results:
        loss = next((x for x in r.losses if not math.isfinite(x)), None)
        if loss is not None:
            return f"the loss is {loss} on rank {r.rank} (stage {last_stage})"
    norm = results[0].grad_norm
    first = min(((-s, r.rank) for r in results for s in r.nonfinite_stages), default=None)
    if math.isfinite(norm):  # finite, but its squares would overflow the optimizer's second moment
        return f"the gradient norm is {norm:.4g}, too large for the optimizer's squared-gradient moment"
    return f"the gradient norm is {norm}" + (f" (first on rank {first[1]}, stage {-first[0]})" if first else "")


def last_checkpoint(job: Job, run_dir: Path) -> str:
    """The checkpoint a resume of the run would start from: the run's latest, else the one it resumed from."""
    saved = checkpoint.complete_checkpoints(run_dir / run_files.CHECKPOINTS)
    if saved:
        return str(saved[-1])
    return str(job.loaded[0]) if job.loaded and job.cfg.checkpoint.resume else "none"


AUTO_CALL_SHARE = 0.02  # the round trip's share of a step from which --steps-per-call auto runs several a call
AUTO_CALL_TARGET = 0.005  # the share it brings it to
AUTO_CALL_MAX_S = 0.5  # the longest such a call grows: the log and the watchdog's view stay close to the steps
MOST_STEPS_A_CALL = 32
AUTO_JUDGED_ON = 8  # warm steps (after the cold COMPILE_STEPS) the round trip is judged on, once


def auto_steps_per_call(history: list[StepMetrics]) -> tuple[int, str | None]:
    """--steps-per-call auto's choice, made once on the warm steps of `history` (one a call so far): how many
    steps a call from now on, and the line that says so when it is more than one. Where the driver's round
    trip costs AUTO_CALL_SHARE of a step or more (steps of a few ms: tiny models, CPU), enough steps a call to
    bring it under AUTO_CALL_TARGET, a call lasting at most AUTO_CALL_MAX_S; GPU-sized steps stay at one."""
    recent = history[COMPILE_STEPS:]
    if not recent or any(m.control_s is None for m in recent):
        return 1, None
    control, step = (statistics.median(getattr(m, k) for m in recent) for k in ("control_s", "step_time_s"))
    if control < AUTO_CALL_SHARE * step:
        return 1, None
    count = min(MOST_STEPS_A_CALL, math.ceil(round(control / (AUTO_CALL_TARGET * step), 6)),
                max(1, math.floor(AUTO_CALL_MAX_S / step)))
    if count == 1:
        return 1, None
    return count, (f"pipegpt: the driver's call takes {control * 1e3:.1f} ms of each {step * 1e3:.1f} ms step: "
                   f"{count} steps a call from step {history[-1].step + 1} (--steps-per-call auto; 1: one a call)")


def train(job: Job, log: RunLog, on_step: Callable[[StepMetrics], None] = lambda m: None) -> list[StepMetrics]:
    """The training loop on a started job: a call of one step or more (--steps-per-call), each step's metrics, an
    evaluation and a checkpoint when due; then the last step's trace (trace.json). A step whose loss or gradient
    norm is not finite was not applied: it stops the run (NonFiniteError) or, with --on-nonfinite skip, is
    counted and the run goes on."""
    cfg, history, results = job.cfg, [], None
    auto = cfg.runtime.steps_per_call == "auto"
    most = 1 if auto else cfg.runtime.steps_per_call
    traced = set(cfg.runtime.traced_steps())
    profiled = profiled_steps(cfg, job.first_step)
    step = job.first_step
    while step < cfg.runtime.steps:
        warm = len(job.step_times) >= COMPILE_STEPS  # the cold first steps run one a call, each with its deadline
        count = call_length(cfg, step, profiled, most if warm else 1)
        with profiling(job, profiled, range(step, step + count), log.run_dir / run_files.PROFILES):
            cpu0 = time.process_time()
            done = job.steps(step, count)
            cpu_per_s = (time.process_time() - cpu0) / max(sum(elapsed for _, elapsed in done), 1e-12)
        for results, elapsed in done:
            metrics = step_metrics(step + 1, results, cfg, elapsed, cpu_per_s * elapsed)
            metrics.skipped_steps = history[-1].skipped_steps if history else 0
            if step in traced:
                log.trace(results, job.plan, step + 1)
            _after_step(job, log, step, results, metrics)
            history.append(metrics)
            on_step(metrics)
            step += 1
            if auto and len(history) == COMPILE_STEPS + AUTO_JUDGED_ON:
                most, line = auto_steps_per_call(history)
                _warn(line)
    if results is not None:
        log.trace(results, job.plan)
    return history


def _after_step(job: Job, log: RunLog, step: int, results: list[WorkerStep], metrics: StepMetrics) -> None:
    """What follows a step on the driver: its non-finite values said, an evaluation and a checkpoint or
    snapshot when due, its metrics row."""
    cfg = job.cfg
    if not all(r.applied for r in results):
        metrics.nonfinite = nonfinite_cause(results, job.plan.num_stages - 1)
        if cfg.optim.on_nonfinite == "stop":
            log.step(metrics)  # the row says what was not finite
            raise NonFiniteError(f"step {step + 1}: {metrics.nonfinite}; no update applied, "
                                 f"last checkpoint: {last_checkpoint(job, log.run_dir)}")
        metrics.skipped_steps += 1
        _warn(f"pipegpt: step {step + 1}: {metrics.nonfinite}; update skipped (--on-nonfinite skip)")
    if job.failed_at is not None and step == job.first_step:
        metrics.recovery_s = time.time() - job.failed_at
        metrics.steps_lost = job.steps_lost
    if evaluation_due(cfg, step):
        metrics.val_loss = job.evaluate()
        if cfg.eval.hellaswag:
            metrics.hellaswag_acc, metrics.hellaswag_acc_norm = job.hellaswag()
    if checkpoint_due(cfg, step):
        t0 = time.perf_counter()
        try:
            job.save(log.run_dir / run_files.CHECKPOINTS, step + 1)
        except NonFiniteError as e:
            log.step(metrics)
            raise NonFiniteError(f"{e}, last checkpoint: {last_checkpoint(job, log.run_dir)}") from None
        metrics.checkpoint_s = time.perf_counter() - t0
    elif snapshot_due(cfg, step):
        t0 = time.perf_counter()
        job.snapshot(log.run_dir, step + 1)
        metrics.snapshot_s = time.perf_counter() - t0
    log.step(metrics)


def _warn(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)


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

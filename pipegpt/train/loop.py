"""The training loop on a started job (pipegpt.train.driver.Job): calls of one step or more (--steps-per-call), and
after each step what is due: a step whose update was not applied (non-finite values), an evaluation, a
checkpoint or snapshot, a profile started or stopped, the step's metrics row.

Each question the loop asks is a small function here: whether a checkpoint, a snapshot or an evaluation is due
after a step (checkpoint_due, ...), how many steps the next call runs (call_length, auto_steps_per_call), and
what a non-finite step means (the section at the end: the one place that decides it).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from pipegpt.config import COMPILE_STEPS, TrainConfig
from pipegpt.engine.results import WorkerStep
from pipegpt.observe.metrics import RunLog, StepMetrics, step_metrics
from pipegpt.observe.profile import problem_line
from pipegpt.state import checkpoint
from pipegpt import run_files


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
            cpu0, sent = time.process_time(), time.perf_counter()
            done = job.steps(step, count)
            call = (sent, time.perf_counter(), count)  # the trace's driver part (pipegpt.observe.step_time)
            cpu_per_s = (time.process_time() - cpu0) / max(sum(elapsed for _, elapsed in done), 1e-12)
        for results, elapsed in done:
            metrics = step_metrics(step + 1, results, cfg, elapsed, cpu_per_s * elapsed)
            if step in traced:
                log.trace(results, job.plan, step + 1, call)
            after_step(job, log, step, results, metrics, history)
            history.append(metrics)
            on_step(metrics)
            step += 1
            if auto and len(history) == COMPILE_STEPS + AUTO_JUDGED_ON:
                most, line = auto_steps_per_call(history)
                if step < cfg.runtime.steps:  # not said of steps that will never run
                    warn(line)
    if results is not None:
        log.trace(results, job.plan, None, call)  # trace.json: the last step
    return history


def after_step(job: Job, log: RunLog, step: int, results: list[WorkerStep], metrics: StepMetrics,
               history: list[StepMetrics]) -> None:
    """What follows a step on the driver: its non-finite values said, an evaluation and a checkpoint or
    snapshot when due (no checkpoint of a skipped step), its metrics row."""
    cfg = job.cfg
    check_applied(job, log, step, results, metrics, history)
    if job.failed_at is not None and step == job.first_step:
        metrics.recovery_s = time.time() - job.failed_at
        metrics.steps_lost = job.steps_lost
    if evaluation_due(cfg, step):
        metrics.val_loss = job.evaluate()
        if cfg.eval.hellaswag:
            metrics.hellaswag_acc, metrics.hellaswag_acc_norm = job.hellaswag()
    if checkpoint_due(cfg, step) and metrics.nonfinite:
        warn(f"pipegpt: no checkpoint after step {step + 1}: its update was skipped; last checkpoint: "
             f"{last_checkpoint(job, log.run_dir)}")
    elif checkpoint_due(cfg, step):
        t0 = time.perf_counter()
        save_finite(job, log, step, metrics)
        metrics.checkpoint_s = time.perf_counter() - t0
    elif snapshot_due(cfg, step):
        t0 = time.perf_counter()
        job.snapshot(log.run_dir, step + 1)
        metrics.snapshot_s = time.perf_counter() - t0
    log.step(metrics)


def warn(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is saved after `step`: every --save-every steps, and after the last (also with
    --save-every 0 unless --no-save-final)."""
    last = cfg.checkpoint.save_final and step == cfg.runtime.steps - 1
    return last or _every(cfg.checkpoint.save_every, step, cfg.runtime.steps)


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
        warn(problem_line(job.call("profile_start", str(directory.resolve())), "the run goes on without profiles"))
    yield
    if profiled and profiled[-1] in steps:
        stopped = job.cluster.call("profile_stop", timeout_s=job.cfg.runtime.timeout_s + 60)
        warn(problem_line([problem for _, problem in stopped], "no profile from it"))


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


# --------------------------------------------------------------------------------------------------------------
# a step whose values are not finite: its update was not applied on any rank

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


def check_applied(job: Job, log: RunLog, step: int, results: list[WorkerStep], metrics: StepMetrics,
                  history: list[StepMetrics]) -> None:
    """The run's count of skipped steps in the step's metrics; a step that some rank did not apply (no rank then
    applies it) says where its values stopped being finite, and stops the run there (--on-nonfinite stop: its
    metrics row written, NonFiniteError) or is counted and the run goes on (skip), up to --max-skipped-steps in a
    row: a run that skips every step would otherwise end "successfully" with nothing learned."""
    metrics.skipped_steps = history[-1].skipped_steps if history else 0
    if all(r.applied for r in results):
        return
    metrics.nonfinite = nonfinite_cause(results, job.plan.num_stages - 1)
    if job.cfg.optim.on_nonfinite == "stop":
        log.step(metrics)  # the row says what was not finite
        raise NonFiniteError(f"step {step + 1}: {metrics.nonfinite}; no update applied, "
                             f"last checkpoint: {last_checkpoint(job, log.run_dir)}")
    metrics.skipped_steps += 1
    warn(f"pipegpt: step {step + 1}: {metrics.nonfinite}; update skipped (--on-nonfinite skip)")
    in_a_row = 1 + next((i for i, m in enumerate(reversed(history)) if not m.nonfinite), len(history))
    most = job.cfg.optim.max_skipped_steps
    if most and in_a_row >= most:
        log.step(metrics)
        raise NonFiniteError(f"step {step + 1}: {in_a_row} steps in a row skipped (--max-skipped-steps {most}); "
                             f"stopping, last checkpoint: {last_checkpoint(job, log.run_dir)}")


def save_finite(job: Job, log: RunLog, step: int, metrics: StepMetrics) -> None:
    """The checkpoint after `step`; one holding a non-finite value is never written (Job.save refuses it: it would
    push out the finite ones), and the run stops there, its metrics row written and its last checkpoint named."""
    try:
        job.save(log.run_dir / run_files.CHECKPOINTS, step + 1)
    except NonFiniteError as e:
        log.step(metrics)
        raise NonFiniteError(f"{e}, last checkpoint: {last_checkpoint(job, log.run_dir)}") from None

"""Random valid runs for the composition fuzzer: a layout, a schedule, a model and the run's options, drawn from one
seed, so that any case a campaign reports is rerun exactly from its seed.

A draw picks every option independently and keeps the first combination `check` accepts (the same check `pipegpt
run` makes before any process starts), so the fuzzer explores what a user may ask for, refusals aside. Up to 4 ranks:
the CPU machines this runs on have 2 cores, and 4 gloo ranks on them are still quick.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan

MAX_RANKS = 4
GPT2 = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_embd=32)
LLAMA_GQA = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                        arch="llama", bias=False, tie_embeddings=False)
MODELS = {"gpt2": GPT2, "gpt2-untied": dataclasses.replace(GPT2, tie_embeddings=False), "llama-gqa": LLAMA_GQA,
          "llama-mqa": dataclasses.replace(LLAMA_GQA, n_kv_head=1),
          "llama-tied-qkv-bias": dataclasses.replace(LLAMA_GQA, qkv_bias=True, tie_embeddings=True)}
RANDOM_FILE = "random-file"  # a schedule file of a random valid order, written by random_schedule_text


@dataclass(frozen=True)
class Case:
    """One drawn run: the model's name, the settings TrainConfig.replace takes, a schedule file's text when the
    schedule is a random order, and the layout a checkpoint taken after `resume_after` steps is resumed into."""

    seed: int
    model: str
    settings: dict
    schedule_text: str | None = None
    resume_settings: dict | None = None
    resume_after: int = 2
    tried: int = field(default=1, compare=False)  # draws until one was accepted

    def describe(self) -> str:
        s = self.settings
        parts = [f"seed {self.seed}", self.model, layout_name(s), s["schedule"] if self.schedule_text is None else
                 RANDOM_FILE, f"m{s['microbatches']}"]
        parts += [f"{k}={v}" for k, v in s.items() if k in OPTIONAL and v != OPTIONAL[k]]
        if self.resume_settings is not None:
            parts.append(f"-> resume into {layout_name(self.resume_settings)} {self.resume_settings['schedule']} "
                         f"zero {self.resume_settings.get('zero', 0)}")
        return " ".join(parts)


OPTIONAL = {"sequence_parallel": False, "cp_comm": "ring", "zero": 0, "unshard": None, "recompute": "none",
            "virtual_stages": None, "grad_clip": 1.0}


def layout_name(settings: dict) -> str:
    return "dp{dp} pp{stages} cp{cp} tp{tp}".format(**{"dp": 1, "cp": 1, "tp": 1, **settings})


def config(case_settings: dict, model: str, schedule_file: str | None = None) -> TrainConfig:
    """The run's configuration in float64: a composition bug cannot hide in rounding there."""
    settings = dict(case_settings)
    if schedule_file is not None:
        settings["schedule_file"] = schedule_file
    return TrainConfig.build(MODELS[model], microbatch_size=2, device="cpu", seed=7, lr=1e-3, timeout_s=60,
                             dtype="float64").replace(**settings)


def draw(seed: int, check=None) -> Case:
    """The case of this seed: the first draw that `check(cfg)` accepts (default: pipegpt.train's check)."""
    if check is None:
        from pipegpt.train.preflight import check
    rng = random.Random(seed)
    for tried in range(1, 200):
        model = rng.choice(sorted(MODELS))
        settings, text = _draw_settings(rng)
        try:
            check(config(settings, model))
        except (ConfigError, ScheduleError):
            continue
        resume = None
        if rng.random() < 0.5:
            resume = _draw_resume(rng, settings, model, check)
        return Case(seed, model, settings, text, resume, tried=tried)
    raise RuntimeError(f"seed {seed}: no valid case in 200 draws")


def _draw_settings(rng: random.Random) -> tuple[dict, str | None]:
    world = rng.choice([1, 2, 2, 4, 4])
    dp, pp, cp, tp = _split(rng, world)
    settings = {"dp": dp, "stages": pp, "cp": cp, "tp": tp}
    text = None
    names = [n for n in SCHEDULES] + [RANDOM_FILE]
    name = rng.choice(names)
    v = None
    if name == "interleaved-1f1b" or (name == "auto" and rng.random() < 0.3):
        v = 2
        settings["virtual_stages"] = v
    m = rng.choice(_microbatch_counts(name, pp, v))
    if name == RANDOM_FILE:
        text = random_schedule_text(rng, pp, m)
        name = "1f1b"  # the run reads the file; the name is what a resume without it uses
    settings.update(schedule=name, microbatches=m)
    if tp > 1 and rng.random() < 0.5:
        settings["sequence_parallel"] = True
    if cp > 1:
        settings["cp_comm"] = rng.choice(["ring", "allgather"])
    if dp * cp > 1:
        settings["zero"] = rng.choice([0, 1, 2, 3])
        if settings["zero"] == 3:
            settings["unshard"] = rng.choice(["step", "microbatch"])
    settings["recompute"] = rng.choice(["none", "full", "selective"])
    settings["grad_clip"] = rng.choice([1.0, 0.0])
    return settings, text


def _draw_resume(rng: random.Random, settings: dict, model: str, check) -> dict | None:
    """Another layout of the same global batch (dp x microbatches kept), or None when none is accepted."""
    batch = settings["dp"] * settings["microbatches"]
    for _ in range(50):
        other, _ = _draw_settings(rng)
        if batch % other["dp"]:
            continue
        other["microbatches"] = batch // other["dp"]
        other.pop("virtual_stages", None)
        if other["schedule"] in ("interleaved-1f1b", "auto"):
            other["schedule"] = "1f1b"
        try:
            check(config(other, model))
        except (ConfigError, ScheduleError):
            continue
        return other
    return None


def _split(rng: random.Random, world: int) -> tuple[int, int, int, int]:
    """dp x pp x cp x tp = world, each a power of two, drawn axis by axis."""
    sizes, left = [], world
    for _ in range(3):
        size = rng.choice([s for s in (1, 2, 4) if left % s == 0])
        sizes.append(size)
        left //= size
    sizes.append(left)
    rng.shuffle(sizes)
    return tuple(sizes)


def _microbatch_counts(name: str, pp: int, v: int | None) -> list[int]:
    counts = []
    for m in range(1, 2 * pp + 3):
        if name == RANDOM_FILE:
            counts.append(m)
            continue
        try:
            build_plan(name, pp, m, *((v,) if v else ()))
        except (ScheduleError, TypeError):
            continue
        counts.append(m)
    return counts or [2 * pp]


def random_schedule_text(rng: random.Random, stages: int, microbatches: int) -> str:
    """A schedule file of a random valid order, stage s on rank s: a random topological order of the step's compute
    actions, each backward whole (B) or split into I and W at random, cut into one line per rank."""
    split = {(s, mb): rng.random() < 0.5 for s in range(stages) for mb in range(microbatches)}
    done: set[tuple[str, int, int]] = set()

    def ready(kind: str, s: int, mb: int) -> bool:
        if kind == "F":
            return s == 0 or ("F", s - 1, mb) in done
        if kind in ("B", "I"):
            later = s == stages - 1 or ("B", s + 1, mb) in done or ("I", s + 1, mb) in done
            return ("F", s, mb) in done and later
        return ("I", s, mb) in done  # W

    todo = [("F", s, mb) for s in range(stages) for mb in range(microbatches)]
    todo += [(("I" if split[s, mb] else "B"), s, mb) for s in range(stages) for mb in range(microbatches)]
    todo += [("W", s, mb) for s in range(stages) for mb in range(microbatches) if split[s, mb]]
    lines: list[list[str]] = [[] for _ in range(stages)]
    while todo:
        kind, s, mb = action = rng.choice([a for a in todo if ready(*a)])
        todo.remove(action)
        done.add(action)
        lines[s].append(f"{s}{kind}{mb}")
    return "# a random valid order (tests/fuzz)\n" + "\n".join(" ".join(line) for line in lines) + "\n"

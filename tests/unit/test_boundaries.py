"""Module boundaries from DESIGN.md, each checked in a fresh interpreter.

A child `python -c` imports the modules under test and prints which pipegpt modules and which
top-level third-party modules ended up in sys.modules. Importing all submodules of a package in
one interpreter checks each of them: whatever one of them loads is in the union. When the union
breaks a boundary, the test names the submodule(s) responsible (one interpreter each).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

PROBE = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
std = set(sys.stdlib_module_names)
tops = {n.split(".")[0] for n in sys.modules}
print(json.dumps({
    "pipegpt": sorted(n for n in sys.modules if n == "pipegpt" or n.startswith("pipegpt.")),
    "third_party": sorted(t for t in tops if t not in std and t != "pipegpt" and not t.startswith("_")
                          and t not in sys.builtin_module_names),
}))
"""


@functools.lru_cache(maxsize=None)
def loaded(*modules: str) -> dict[str, list[str]]:
    """pipegpt.* and top-level third-party modules loaded by importing `modules` in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", PROBE, *modules], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:  # not an AssertionError: a known violation's xfail must not absorb it
        raise RuntimeError(f"importing {modules} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def submodules(package: str) -> list[str]:
    """The package and every module under it, found on disk (nothing is imported here)."""
    base = ROOT.joinpath(*package.split("."))
    found = []
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if all(part.isidentifier() for part in parts):
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(set(found))


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def check(modules: list[str], forbidden_pipegpt=(), forbid_torch=False) -> None:
    found = loaded(*modules)
    bad = [n for n in found["pipegpt"] if _under(n, forbidden_pipegpt)]
    if forbid_torch:
        bad += [t for t in found["third_party"] if t == "torch" or t.startswith("torch")]
    if bad and len(modules) > 1:  # name the culprits
        culprits = {}
        for m in modules:
            one = loaded(m)
            why = [n for n in one["pipegpt"] if _under(n, forbidden_pipegpt)]
            why += [t for t in one["third_party"] if forbid_torch and t.startswith("torch")]
            if why:
                culprits[m] = why
        pytest.fail(f"boundary broken: {culprits}")
    assert not bad, f"importing {modules} loaded {bad}; everything loaded: {found}"


def test_schedule_loads_no_torch():
    mods = submodules("pipegpt.schedule")
    assert {"pipegpt.schedule.actions", "pipegpt.schedule.simulate", "pipegpt.schedule.render"} <= set(mods)
    check(mods, forbid_torch=True)


def test_plan_loads_no_torch():
    """The planner (memory model, balance, search) is arithmetic on shapes and plans: `pipegpt plan`
    answers without loading torch, and nothing it imports needs torch either."""
    mods = submodules("pipegpt.planner") + submodules("pipegpt.costs")
    assert {"pipegpt.planner", "pipegpt.costs.memory"} <= set(mods)
    check(mods, ("pipegpt.model.gpt", "pipegpt.stages", "pipegpt.comm", "pipegpt.tensor_parallel.layers",
                 "pipegpt.tensor_parallel.collectives", "pipegpt.stages.runtime", "pipegpt.train.worker",
                 "pipegpt.train.driver"),
          forbid_torch=True)


# The pipeline's execution side shares the stages' folder: the runtime meets the schedule, the stages and comm; the
# Stage (a slice of the model, its forward and backward in pieces) meets none of them, so it is built, measured
# (--balance cost) and tested alone. The boundary is the Stage's modules, not the folder's.
RUNTIME = "pipegpt.stages.runtime"


def stage_modules() -> list[str]:
    return [m for m in submodules("pipegpt.stages") if m != RUNTIME]


def test_stages_load_no_comm_tensor_parallel_schedule_runtime():
    mods = stage_modules()
    assert "pipegpt.stages" in mods and "pipegpt.stages.stage" in mods
    check(mods, ("pipegpt.comm", "pipegpt.tensor_parallel", "pipegpt.schedule", RUNTIME,
                 "pipegpt.train.worker", "pipegpt.train.driver"))


def test_the_runtime_meets_schedule_stages_and_comm_and_nothing_of_a_role():
    found = loaded(RUNTIME)
    assert {"pipegpt.schedule.actions", "pipegpt.stages.stage", "pipegpt.comm.p2p"} <= set(found["pipegpt"]), found
    check([RUNTIME], ("pipegpt.tensor_parallel", "pipegpt.data_parallel", "pipegpt.engine", "pipegpt.train",
                      "pipegpt.infer", "pipegpt.planner", "pipegpt.costs"))


def test_model_loads_no_comm_tensor_parallel_schedule_stages_runtime():
    check(["pipegpt.model.gpt"], ("pipegpt.comm", "pipegpt.tensor_parallel", "pipegpt.schedule", "pipegpt.stages",
                              "pipegpt.stages.runtime", "pipegpt.train.worker", "pipegpt.train.driver"))


def test_split_backward_loads_no_model_comm_tensor_parallel_schedule_or_stages():
    check(["pipegpt.model.split_backward"], ("pipegpt.model.gpt", "pipegpt.comm", "pipegpt.tensor_parallel",
                                       "pipegpt.schedule", "pipegpt.stages", "pipegpt.stages.runtime",
                                       "pipegpt.train.worker", "pipegpt.train.driver"))


def test_tensor_parallel_loads_no_comm_schedule_stages_runtime():
    mods = submodules("pipegpt.tensor_parallel")
    assert {"pipegpt.tensor_parallel.layout", "pipegpt.tensor_parallel.collectives",
            "pipegpt.tensor_parallel.layers"} <= set(mods)
    check(mods, ("pipegpt.comm", "pipegpt.schedule", "pipegpt.stages", "pipegpt.stages.runtime",
                 "pipegpt.train.worker", "pipegpt.train.driver"))


def test_tensor_parallel_layout_loads_no_torch_model_or_collectives():
    """The layouts serve torch-free code and checkpoints: importing the package, or its layout,
    loads neither torch nor the layers and collectives."""
    for mods in (["pipegpt.tensor_parallel.layout"], ["pipegpt.tensor_parallel"]):
        check(mods, ("pipegpt.tensor_parallel.collectives", "pipegpt.tensor_parallel.layers", "pipegpt.model.gpt",
                     "pipegpt.model.split_backward", "pipegpt.comm", "pipegpt.stages", "pipegpt.schedule",
                     "pipegpt.stages.runtime", "pipegpt.train.worker", "pipegpt.train.driver"), forbid_torch=True)


def test_comm_loads_no_tensor_parallel_schedule_stages_model_runtime():
    mods = submodules("pipegpt.comm")
    assert {"pipegpt.comm.mesh", "pipegpt.comm.p2p", "pipegpt.comm.rpc"} <= set(mods)
    check(mods, ("pipegpt.tensor_parallel", "pipegpt.schedule", "pipegpt.stages", "pipegpt.model.gpt",
                 "pipegpt.model.split_backward", "pipegpt.stages.runtime", "pipegpt.train.worker",
                 "pipegpt.train.driver"))


def test_cli_import_loads_no_torch():
    found = loaded("pipegpt.cli")
    assert "pipegpt.cli" in found["pipegpt"]
    assert not [t for t in found["third_party"] if t.startswith("torch")], found
    # Nor anything that needs torch.
    assert not [n for n in found["pipegpt"] if _under(n, ("pipegpt.model.gpt", "pipegpt.stages", "pipegpt.comm",
                                                          "pipegpt.stages.runtime", "pipegpt.train.worker",
                                                          "pipegpt.train.driver"))], found


def test_the_probe_sees_torch():
    """The probe can fail: importing a torch-using module does show torch and the pipegpt modules."""
    found = loaded(*stage_modules())  # what the stages test above imports
    assert "torch" in found["third_party"]
    assert {"pipegpt.model.gpt", "pipegpt.stages.stage"} <= set(found["pipegpt"])


def test_arch_loads_nothing_else():
    """The architectures' description sits under the config: it loads no torch and no other pipegpt module."""
    found = loaded("pipegpt.arch")
    assert found["pipegpt"] == ["pipegpt", "pipegpt.arch"], found
    assert not found["third_party"], found


def test_config_and_devices_load_no_torch():
    """validate() runs before any worker exists, in a process that need not load torch."""
    check(["pipegpt.config", "pipegpt.engine.placement"], ("pipegpt.schedule", "pipegpt.model.gpt", "pipegpt.comm"),
          forbid_torch=True)


def test_the_engine_serves_any_role_it_loads_no_training():
    """One rank's machinery (device, mesh, stages, point-to-point, runtime) knows no optimizer, loader, checkpoint
    or metrics: an inference role builds on it as the training role does (pipegpt.train.worker)."""
    mods = submodules("pipegpt.engine")
    assert {"pipegpt.engine.engine", "pipegpt.engine.actor"} <= set(mods)
    check(mods, ("pipegpt.train", "pipegpt.data", "pipegpt.observe", "pipegpt.resilience", "pipegpt.state.checkpoint",
                 "pipegpt.state.snapshot", "pipegpt.planner", "pipegpt.costs"))

"""pipegpt.schedule's import graph has no cycle and no torch; its registry declares what build_plan makes.

The graph is read from the source with ast (imports inside functions included), so a lazy import
that hides a cycle at runtime is still caught.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT
from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan, schedule_spec


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports anywhere in its source (package = its __init__)."""
    files = {}
    for path in sorted(root.joinpath(*package.split(".")).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # what `from .` means
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{anchor}.{base}" if base else anchor
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import pkg.mod.attr` -> the deepest module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None; depth-first, in sorted order so the answer is stable."""
    state: dict[str, str] = {}  # "open" while on the stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def imported_top_levels(root: Path, package: str) -> dict[str, set[str]]:
    """Module file -> top-level names of everything it imports (absolute imports only)."""
    found = {}
    for path in sorted(root.joinpath(*package.split(".")).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(root))] = names
    return found


# ---------------------------------------------------------------------------------------------------------
# the import graph


def test_schedule_package_has_no_import_cycle():
    graph = module_graph(ROOT, "pipegpt.schedule")
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in pipegpt.schedule: " + " -> ".join(cycle)


def test_graph_sees_the_shared_helpers():
    graph = module_graph(ROOT, "pipegpt.schedule")
    assert "pipegpt.schedule.messages" in graph["pipegpt.schedule.lowering"]
    assert "pipegpt.schedule.messages" in graph["pipegpt.schedule.validate"]
    assert graph["pipegpt.schedule.messages"] == {"pipegpt.schedule.actions"}
    assert graph["pipegpt.schedule.actions"] == set()


def test_no_torch_anywhere_under_schedule():
    offenders = [f for f, names in imported_top_levels(ROOT, "pipegpt.schedule").items() if "torch" in names]
    assert not offenders, f"pipegpt.schedule must not import torch: {offenders}"


def test_find_cycle_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_module_graph_catches_a_lazy_import_cycle(tmp_path):
    # The shape pipegpt.schedule used to have: one top-level import, one inside a function.
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .low import lower\n")
    (pkg / "low.py").write_text("import os\n\ndef lower():\n    from .check import Error\n    raise Error\n")
    (pkg / "check.py").write_text("from toy.low import lower\nfrom . import helpers\n\nclass Error(Exception):\n"
                                  "    pass\n")
    (pkg / "helpers.py").write_text("import toy.check\n")
    graph = module_graph(tmp_path, "toy")
    assert graph == {"toy": {"toy.low"}, "toy.low": {"toy.check"}, "toy.check": {"toy.low", "toy.helpers"},
                     "toy.helpers": {"toy.check"}}
    assert find_cycle(graph) == ["toy.check", "toy.helpers", "toy.check"]
    (pkg / "helpers.py").write_text("")
    assert find_cycle(module_graph(tmp_path, "toy")) == ["toy.low", "toy.check", "toy.low"]


# ---------------------------------------------------------------------------------------------------------
# the registry


def test_registry_order_is_the_documented_one():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "1f1b-overlap", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev",
                              "auto", "auto-v"]
    assert all(spec.name == name for name, spec in SCHEDULES.items())


@pytest.mark.parametrize("v", [None, 1, 2, 3])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_registry_declares_what_build_plan_makes(name, p, v):
    spec = schedule_spec(name)
    try:
        plan = build_plan(name, p, 4 * p, v)  # 4p microbatches suit every schedule
    except ScheduleError as e:  # a --virtual-stages value that does not apply: the registry says so too
        assert not spec.takes_virtual_stages
        with pytest.raises(ScheduleError) as declared:
            spec.stage_to_rank(p, v)
        assert str(declared.value) == str(e)
        return
    assert plan.name == spec.name and plan.num_ranks == p
    assert plan.stage_to_rank == spec.stage_to_rank(p, v)
    assert plan.num_stages == spec.num_stages(p, v) == p * spec.virtual_stages(v)
    if v is None:
        assert plan.num_stages == p * spec.default_virtual_stages


def test_only_schedules_that_take_virtual_stages_change_with_them():
    for spec in SCHEDULES.values():
        stages = {build_plan(spec.name, 2, 8, v).num_stages for v in (None, 2, 3) if spec.takes_virtual_stages or
                  v in (None, spec.default_virtual_stages)}
        assert (len(stages) > 1) == spec.takes_virtual_stages, spec.name


def test_placement_answers_without_a_valid_plan():
    # dualpipev refuses m < 2p and interleaved m % p != 0, but where stages go does not depend on m.
    assert schedule_spec("dualpipev").stage_to_rank(3) == (0, 1, 2, 2, 1, 0)
    assert schedule_spec("interleaved-1f1b").stage_to_rank(3, 3) == (0, 1, 2) * 3
    with pytest.raises(ScheduleError, match="stages=0 must be at least 1"):
        schedule_spec("1f1b").stage_to_rank(0)


def test_v_placements_put_both_ends_on_one_rank():
    for spec in SCHEDULES.values():
        s2r = spec.stage_to_rank(4)
        assert (s2r[0] == s2r[-1]) == (spec.placement is SCHEDULES["zbv"].placement), spec.name


def test_registry_keeps_the_error_messages():
    with pytest.raises(ScheduleError) as e:
        build_plan("1f1b", 4, 8, 3)
    assert str(e.value) == ("virtual-stages=3 only applies to interleaved-1f1b and auto (zbv, dualpipev and auto-v "
                            "always use 2); leave it out for 1f1b")
    with pytest.raises(ScheduleError) as e:
        build_plan("nope", 4, 8)
    assert str(e.value) == f"unknown schedule 'nope'; known schedules: {', '.join(SCHEDULES)}"
    with pytest.raises(ScheduleError, match="virtual-stages=-1 must be at least 1"):
        build_plan("interleaved-1f1b", 4, 8, -1)

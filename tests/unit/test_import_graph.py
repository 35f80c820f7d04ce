"""The whole package's import graph, read from the source with ast (imports inside functions included):
no cycle, and every import goes down the layer order that docs/architecture.md documents."""
from __future__ import annotations

import re

from helpers import ROOT
from test_schedule_imports import find_cycle, module_graph

# Lowest first: a module may import its own package and the layers before it, never one after it.
LAYERS = [
    "pipegpt.arch",
    "pipegpt.dims",
    "pipegpt.model_config",
    "pipegpt.config",
    "pipegpt.run_files",
    "pipegpt.schedule",
    "pipegpt.model",
    "pipegpt.tensor_parallel",
    "pipegpt.context_parallel",
    "pipegpt.expert_parallel",
    "pipegpt.parallelisms",
    "pipegpt.data",
    "pipegpt.costs",
    "pipegpt.planner",
    "pipegpt.comm",
    "pipegpt.data_parallel",
    "pipegpt.stages",
    "pipegpt.state",
    "pipegpt.engine",
    "pipegpt.observe",
    "pipegpt.resilience",
    "pipegpt.train",
    "pipegpt.infer",
    "pipegpt.tools",
    "pipegpt.command_options",
    "pipegpt.options",
    "pipegpt.cli",
    "pipegpt.__main__",
]


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    raise AssertionError(f"{module} belongs to no documented layer: add it to LAYERS and docs/architecture.md")


def test_package_has_no_import_cycle():
    cycle = find_cycle(module_graph(ROOT, "pipegpt"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_goes_down_the_documented_order():
    graph = module_graph(ROOT, "pipegpt")
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() if a != "pipegpt"
                    for b in targets if b != "pipegpt" and layer_of(b) > layer_of(a))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_order_is_the_one_documented():
    """docs/architecture.md lists the layers in this order (its module map's top-level entries)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```")[1]
    documented = [f"pipegpt.{m}" for m in re.findall(r"^\s*(\w+)(?:/|\.py)", block, re.M)]
    assert documented == LAYERS, documented


def test_the_check_can_fail():
    """An upward edge is reported: the layer of a module is looked up, not assumed."""
    assert layer_of("pipegpt.train.worker") > layer_of("pipegpt.stages.runtime") > layer_of("pipegpt.schedule.actions")
    graph = {"pipegpt.schedule.actions": {"pipegpt.train.worker"}}
    upward = [b for a, t in graph.items() for b in t if layer_of(b) > layer_of(a)]
    assert upward == ["pipegpt.train.worker"]

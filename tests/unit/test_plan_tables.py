"""docs/llama-plan.md's tables of `pipegpt plan` answers are what scripts/plan_tables.py makes from `plan` now:
the one that plans in a few seconds in the default suite, every one in the slow set."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from helpers import ROOT

PAGE = ROOT / "docs" / "llama-plan.md"


def _script():
    spec = importlib.util.spec_from_file_location("plan_tables", ROOT / "scripts" / "plan_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


plan_tables = _script()
BLOCKS = plan_tables.blocks(PAGE.read_text())
FAST = "--model llama3-8b --gpus 8 --device h100 --batch-tokens 131072"  # a few seconds of search


def test_the_page_marks_its_plan_tables():
    assert [b.args for b in BLOCKS] == [
        "--model llama3-405b --gpus 512 --device h100 --batch-tokens 2097152",
        "--model llama3-405b --gpus 512 --device h100 --batch-tokens 16777216",
        "--model llama3-70b --gpus 64 --device h100 --batch-tokens 4194304",
        FAST]
    for b in BLOCKS:
        assert f"pipegpt plan {b.args}" in PAGE.read_text()  # the command stands in the page's text too


@pytest.fixture(scope="module")
def answers():
    """Each table's `plan --json` answer, planned once."""
    made: dict = {}

    def answer(args: str) -> dict:
        if args not in made:
            made[args] = plan_tables.plan_answer(args)
        return made[args]
    return answer


@pytest.mark.parametrize("block", [pytest.param(b, id=b.args.split()[1], marks=() if b.args == FAST
                                                else pytest.mark.slow) for b in BLOCKS])
def test_a_table_is_what_plan_answers_now(block, answers):
    assert block.table == plan_tables.table(answers(block.args)), (
        "docs/llama-plan.md is stale: python scripts/plan_tables.py docs/llama-plan.md --write")


def test_a_changed_number_is_found_stale(tmp_path, capsys, monkeypatch, answers):
    monkeypatch.setattr(plan_tables, "plan_answer", answers)  # the answer planned once
    fast = next(b for b in BLOCKS if b.args == FAST)
    text = "intro\n<!-- plan-table: " + FAST + " -->\n" + fast.table + "<!-- end plan-table -->\nafter\n"
    page = tmp_path / "page.md"
    page.write_text(text)
    assert plan_tables.main([str(page)]) == 0
    first = fast.table.splitlines()[2]
    page.write_text(text.replace(first, first.replace("| 1 |", "| 9 |", 1)))
    assert plan_tables.main([str(page)]) == 1
    assert f"stale: pipegpt plan {FAST}" in capsys.readouterr().out
    assert plan_tables.main([str(page), "--write"]) == 0
    assert page.read_text() == text

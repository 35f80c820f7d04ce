"""`pipegpt run --help` lists its options under the sections of a run's config.json (model, layout, schedule,
training, data, checkpoints, resilience, observability), the most used examples first."""
from __future__ import annotations

import re

from helpers import invoke
from pipegpt.options import HELP_ORDER, help_section


def test_run_help_lists_every_option_under_one_of_its_sections_in_order():
    result = invoke("run", "--help")
    assert result.exit_code == 0, result.output
    text = result.output
    headings = re.findall(r"^(\w+) options:$", text, flags=re.M)
    assert headings == [*HELP_ORDER, "Other"], headings
    other = text.split("Other options:", 1)[1]
    # only the help option is left to "Other" (-h, --help; a context made without the group's settings, as
    # make_context("run", ...) in another test, leaves click's cached option at --help alone)
    listed = [line for line in other.splitlines() if line.startswith("  -")]
    assert len(listed) == 1 and listed[0].split("  ")[1].strip() in ("-h, --help", "--help"), listed
    body = lambda title: text.split(f"{title} options:", 1)[1].split(" options:", 1)[0]  # noqa: E731
    assert "--stages" in body("Layout") and "--tp" in body("Layout") and "--schedule " not in body("Layout")
    assert "--schedule-file" in body("Schedule") and "--microbatches" in body("Schedule")
    assert "--lr " in body("Training") and "--config" in body("Training")
    assert "--save-every" in body("Checkpoints") and "--save-final / --no-save-final" in body("Checkpoints")
    assert "--max-restarts" in body("Resilience") and "--timeout" in body("Resilience")
    assert "--trace-steps" in body("Observability") and "--eval-every" in body("Observability")
    assert "--n-experts" in body("Model") and "--data " in body("Data")


def test_the_three_most_used_examples_come_before_the_options():
    text = invoke("run", "--help").output
    head = text.split("options:", 1)[0]
    examples = [line.strip() for line in head.splitlines() if line.strip().startswith("pipegpt run")]
    assert len(examples) == 3 and "--resume" in examples[2], examples


def test_an_option_no_list_places_is_left_to_other():
    assert help_section("max_restarts") == "Resilience" and help_section("n_layer") == "Model"
    assert help_section("lr") == "Training" and help_section("eval_every") == "Observability"
    assert help_section("an_option_added_later") == "Other"


def test_the_help_examples_parse_with_the_real_command_line():
    import shlex

    from pipegpt.cli import main
    from pipegpt.options import RUN_EXAMPLES

    for example in RUN_EXAMPLES:
        words = shlex.split(example.split("#", 1)[0])
        assert words[:2] == ["pipegpt", "run"]
        main.commands["run"].make_context("run", words[2:])

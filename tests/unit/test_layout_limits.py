"""The sizes a reader can finish in one sitting: cli.py declarations only, no module over 600 lines, no package
over 12 modules. The limits drifted twice before this test held them."""
from __future__ import annotations

from helpers import ROOT

PACKAGE = ROOT / "pipegpt"
MAX_MODULE_LINES, MAX_CLI_LINES, MAX_PACKAGE_MODULES = 600, 350, 12


def lines(path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_longer_than_a_sitting():
    long = {str(p.relative_to(ROOT)): lines(p) for p in PACKAGE.rglob("*.py") if lines(p) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_command_line_is_declarations():
    assert lines(PACKAGE / "cli.py") <= MAX_CLI_LINES


def test_no_package_holds_more_than_a_dozen_modules():
    crowded = {}
    for package in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_PACKAGE_MODULES:
            crowded[str(package.relative_to(ROOT))] = len(modules)
    assert not crowded, f"packages over {MAX_PACKAGE_MODULES} modules: {crowded}"

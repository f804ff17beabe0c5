"""How the test suite itself is laid out: test modules share helpers through ``tests/support/`` only,
and the list of slow integration modules (tests/conftest.py) names modules that exist."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import SLOW_INTEGRATION

TESTS = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e", "engine")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports by absolute name (``from a.b import c`` counts a.b and a.b.c)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules_of_tests(path: Path) -> list[str]:
    """The test modules among what ``path`` imports (tests.<tier>.test_*)."""
    parts = (module.split(".") for module in imported_modules(path))
    return sorted({".".join(p[:3]) for p in parts
                   if len(p) >= 3 and p[0] == "tests" and p[1] in TIERS and p[2].startswith("test_")})


@pytest.mark.parametrize("path", sorted(TESTS.glob("*/test_*.py")), ids=lambda p: str(p.relative_to(TESTS)))
def test_a_test_module_imports_no_other_test_module(path: Path):
    assert modules_of_tests(path) == [], "move what they share to tests/support/"


def test_support_imports_nothing_from_a_tier():
    # A helper that needs a tier's conftest or test module belongs in tests/support/ with it.
    found = {str(p.relative_to(TESTS)): sorted(m for m in imported_modules(p) if m.split(".")[:2] in
                                                [["tests", tier] for tier in TIERS])
             for p in (TESTS / "support").glob("*.py")}
    assert {path: modules for path, modules in found.items() if modules} == {}


def test_the_checker_sees_each_form_of_import(tmp_path: Path):
    # The control: each way of spelling an import of a test module is found.
    module = tmp_path / "test_x.py"
    module.write_text("import tests.e2e.test_a\nfrom tests.unit.test_b import f\nfrom tests.integration import test_c\n"
                      "from tests.support.waiting import eventually\n")
    assert modules_of_tests(module) == ["tests.e2e.test_a", "tests.integration.test_c", "tests.unit.test_b"]


def test_every_slow_integration_module_exists():
    # A renamed module would silently rejoin the fast tier.
    assert sorted(m for m in SLOW_INTEGRATION if not (TESTS / "integration" / f"{m}.py").exists()) == []

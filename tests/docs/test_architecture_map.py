"""docs/architecture.md's module map is today's package: every module is named in the map
exactly once, and no path the page names is a file that does not exist.

A module added without a line in the map, or removed while the map still names it, fails
here; the fix is a line in the map (docs/architecture.md, "Module map")."""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# The package's top folders (setup.py maps each to rankguard.<folder>).
PACKAGES = (
    "contract",
    "service",
    "agent",
    "supervisor",
    "client",
    "trainer",
    "cli",
    "dashboards",
    "deploy",
)
# Other folders whose files the page may name: they must exist too.
OTHER = ("bench", "tests", "scripts", "examples")
PKGS, TOPS = "|".join(PACKAGES), "|".join(PACKAGES + OTHER)
PATH = re.compile(rf"(?<![\w/.-])((?:{TOPS})/[\w/.-]*\.py)\b")
# A module's line in the map: a table row whose first cell is its path.
ROW = re.compile(rf"^\| `((?:{PKGS})/[\w/.-]*\.py)` \|", re.M)


def is_marker(path: Path) -> bool:
    """An `__init__.py` with nothing but (at most) a docstring: the map may leave it out."""
    if path.name != "__init__.py":
        return False
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def package_modules(root: Path = ROOT) -> set[str]:
    out = set()
    for top in PACKAGES:
        for p in (root / top).rglob("*.py"):
            if "__pycache__" not in p.parts and not is_marker(p):
                out.add(p.relative_to(root).as_posix())
    return out


def map_section(doc: str) -> str:
    start = doc.index("\n## Module map\n")
    end = doc.find("\n## ", start + 1)
    return doc[start : end if end != -1 else len(doc)]


def map_problems(doc: str, modules: set[str], exists: Callable[[str], bool]) -> list[str]:
    """What is wrong with the page against the package: modules missing from the map or
    named twice there, and paths named anywhere on the page that do not exist."""
    in_map = Counter(ROW.findall(map_section(doc)))
    problems = [f"missing from the module map: {m}" for m in sorted(modules - set(in_map))]
    problems += [
        f"named {n} times in the module map: {m}" for m, n in sorted(in_map.items()) if n > 1
    ]
    problems += [
        f"named but does not exist: {p}" for p in sorted(set(PATH.findall(doc))) if not exists(p)
    ]
    return problems


def exists(path: str) -> bool:
    return (ROOT / path).is_file()


def test_the_map_names_every_module_once_and_nothing_that_is_gone():
    assert map_problems(DOC.read_text(), package_modules(), exists) == []


def test_the_package_listing_sees_modules_and_skips_empty_package_markers():
    modules = package_modules()
    assert {"agent/api.py", "supervisor/detectors/hang.py", "deploy/__init__.py"} <= modules
    assert "agent/collectors/__init__.py" in modules  # it holds the registry
    assert "agent/__init__.py" not in modules  # empty


def test_a_module_added_without_a_line_in_the_map_fails():
    doc = DOC.read_text()
    problems = map_problems(doc, package_modules() | {"agent/new_collector_helper.py"}, exists)
    assert problems == ["missing from the module map: agent/new_collector_helper.py"]


def test_a_module_the_map_names_that_does_not_exist_fails():
    doc = DOC.read_text().replace(
        "| `agent/api.py` |", "| `agent/gone.py` | a module removed since |\n| `agent/api.py` |"
    )
    problems = map_problems(doc, package_modules(), exists)
    assert problems == ["named but does not exist: agent/gone.py"]


def test_a_module_named_twice_in_the_map_fails():
    doc = DOC.read_text().replace(
        "| `agent/api.py` |", "| `agent/health.py` | again |\n| `agent/api.py` |"
    )
    assert map_problems(doc, package_modules(), exists) == [
        "named 2 times in the module map: agent/health.py"
    ]

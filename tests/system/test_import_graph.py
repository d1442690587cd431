"""The import graph (scripts/import-graph): no cycle between the packages or between the
modules of supervisor/ (and of agent/, once its last one is untangled), and contract/, the
language every part speaks, imports no other part of rankguard."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import-graph"


def _load():
    loader = importlib.machinery.SourceFileLoader("import_graph", str(SCRIPT))
    spec = importlib.util.spec_from_loader("import_graph", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


ig = _load()


@pytest.fixture(scope="module")
def graph():
    return ig.module_graph(ROOT)


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_no_import_cycle_inside_supervisor(graph):
    assert ig.cycles(ig.inside(graph, "supervisor")) == []


def test_no_import_cycle_inside_agent(graph):
    assert ig.cycles(ig.inside(graph, "agent")) == []


def test_no_cycle_between_the_packages_and_contract_imports_none_of_them(graph):
    packages = ig.package_graph(graph)
    assert ig.cycles(packages) == []
    assert packages["contract"] == set()
    assert packages["supervisor"] <= {"contract", "service"}  # never the agent's code


def test_the_script_prints_the_package_graph_and_exits_0_without_cycles():
    proc = script()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split() == ["contract", "->", "(nothing)"] for line in lines), proc.stdout
    assert lines[-1] == "cycles between packages: none"
    assert script("--cycles", "supervisor").stdout == "supervisor: no import cycles\n"
    assert "import-graph" in script("--help").stdout


def test_a_cycle_is_found_however_its_import_is_hidden(tmp_path):
    """Deferred into a function it still counts; under TYPE_CHECKING it does not; nor does
    a registry's entry importing the package that loads it (`from . import REGISTRY`)."""
    pkg = tmp_path / "supervisor"
    (pkg / "plugins").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nfrom rankguard.supervisor import a\n"
        "if TYPE_CHECKING:\n    from .plugins import one\n"
    )
    (pkg / "plugins" / "__init__.py").write_text("from . import one\nREGISTRY = []\n")
    (pkg / "plugins" / "one.py").write_text("from . import REGISTRY\nfrom .. import c\n")
    proc = script("--root", str(tmp_path), "--cycles", "supervisor")
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "supervisor: 1 import cycle",
        "  supervisor.a -> supervisor.b -> supervisor.a",
    ]
    shown = script("--root", str(tmp_path), "--module", "supervisor").stdout.splitlines()
    edges = dict(line.replace(" ", "").split("->") for line in shown)
    assert edges["supervisor.c"] == "supervisor.a"
    assert edges["supervisor.plugins"] == "supervisor.plugins.one"
    assert edges["supervisor.plugins.one"] == "supervisor.c"

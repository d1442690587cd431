"""The documentation: the MkDocs site builds in strict mode (a broken link or anchor, or a
page left out of the nav, fails), every alert rule links a runbook section that exists,
and README.md and docs/ stay a front door and a manual, not a diary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard.dashboards.rules import RUNBOOK_BASE, rule_file

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# How a development diary reads: numbered work sessions, issues, rounds, waves (not the
# `--rounds N` option of a benchmark).
HISTORY = re.compile(
    r"\b[Ss]essions? \d|\b[Ii]ssues? #?\d|(?<!-)\b[Rr]ounds? \d|\b[Ww]aves? \d"
    r"|\b(?:first|second|third|fourth) round\b|(?<![\w&])#\d{2,}\b"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_the_site_builds_strict_with_every_page(site):
    pages = {p.stem for p in DOCS.glob("*.md")}
    built = {p.parent.name for p in site.glob("*/index.html")} | {"index"}
    assert pages <= built, pages - built


def test_every_alert_links_its_runbook_section_and_the_section_exists(site):
    page = (site / "operations" / "index.html").read_text()
    anchors = set(re.findall(r'\bid="([^"]+)"', page))
    alerts = [r for g in rule_file()["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 20
    text = (ROOT / RUNBOOK_BASE).read_text()
    for rule in alerts:
        url = rule["annotations"]["runbook_url"]
        doc, _, anchor = url.partition("#")
        assert doc == "docs/operations.md" and (ROOT / doc).is_file(), url
        assert anchor == rule["alert"].lower() and anchor in anchors, url
        section = text.split(f"\n### {rule['alert']}\n", 1)[1].split("\n### ", 1)[0]
        assert "- Check:" in section and "- Do:" in section, rule["alert"]


def test_the_checked_in_rules_carry_the_runbook_links():
    rules = (ROOT / "deploy/prometheus/rankguard-rules.yml").read_text()
    assert rules.count("runbook_url:") == rules.count("- alert:")


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 12_500, len(text.encode())
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.startswith("rankguard up"))
    assert first_command < 50, "the first command is not on the first screen"
    assert "/tmp/" not in text and "/work/" not in text


@pytest.mark.parametrize("page", sorted([README, *DOCS.glob("*.md")]), ids=lambda p: p.name)
def test_no_development_history(page):
    hits = [f"{page.name}:{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if HISTORY.search(line)]  # fmt: skip
    assert not hits, "\n".join(hits)


def test_docs_name_temporary_paths_only_in_examples():
    for page in DOCS.glob("*.md"):
        fenced = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            fenced ^= line.startswith("```")
            assert fenced or "/tmp/" not in line, f"{page.name}:{n}: {line}"

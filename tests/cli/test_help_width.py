"""Every command's help fits the terminal: at 80 and 120 columns no line is wider, no
option name or text is cut short ("…"), and every option is shown by its whole name."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from rankguard.cli.main import build

app = build()


def _commands(cmd, path=()):
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize(
    "path,cmd", COMMANDS, ids=[" ".join(p) or "rankguard" for p, _ in COMMANDS]
)
def test_help_fits_the_terminal(path, cmd, width):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) > 3, result.output
    wide = [line for line in lines if len(line) > width]
    assert wide == [], "\n".join(wide)
    cut = [line for line in lines if "…" in line]
    assert cut == [], "\n".join(cut)
    shown = set(re.findall(r"--[a-z][a-z0-9-]*", result.output))
    names = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    hidden = {o for p in cmd.params if getattr(p, "hidden", False) for o in p.opts}
    assert names - hidden <= shown, sorted(names - hidden - shown)


def test_up_help_is_grouped_into_panels_and_keeps_bracketed_words():
    out = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "80"}).output
    for panel in ("Run", "The bundled trainer", "Checkpoints", "Faults and hang detection",
                  "Worker start-up"):  # fmt: skip
        assert re.search(rf"╭─ {re.escape(panel)}", out), out
    sup = CliRunner().invoke(app, ["supervisor", "--help"], env={"COLUMNS": "80"}).output
    # help text in brackets is text, not rich markup that vanishes
    assert "[supervisor] interval" in " ".join(sup.split()), sup

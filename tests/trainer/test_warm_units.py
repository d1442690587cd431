"""Warm start's pure parts (trainer/warm.py, cli/up.py warm_script): what the shim asks
for, and a script run in-process the way `python` would (argv, sys.path[0], __main__,
exit status). No server, no subprocess: the real forks are in test_warm.py."""

from __future__ import annotations

import os
import sys

import pytest

from rankguard.cli.up import warm_script
from rankguard.trainer import warm


def test_the_shim_argv_names_the_trainer_a_script_or_a_module():
    assert warm.parse_target(["--preset", "tiny"]) == ("trainer", None, ["--preset", "tiny"])
    assert warm.parse_target(["--script", "t.py", "--lr", "3"]) == ("script", "t.py", ["--lr", "3"])
    assert warm.parse_target(["--module", "pkg.train"]) == ("module", "pkg.train", [])
    with pytest.raises(ValueError, match="needs a script"):
        warm.parse_target(["--script"])


def test_up_hands_a_script_or_module_to_the_shim():
    run = ["-m", "rankguard.trainer.warm", "run"]
    assert warm_script(["t.py", "--lr", "3"]) == [*run, "--script", "t.py", "--lr", "3"]
    assert warm_script(["-m", "pkg.train", "-x"]) == [*run, "--module", "pkg.train", "-x"]
    kind, name, args = warm.parse_target(warm_script(["-m", "pkg.train", "-x"])[3:])
    assert (kind, name, args) == ("module", "pkg.train", ["-x"])


def test_sys_path0_is_the_scripts_directory_or_the_cwd(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.py").write_text("")
    os.symlink(tmp_path / "real" / "t.py", tmp_path / "link.py")
    assert warm.script_path0("script", "real/t.py", str(tmp_path)) == str(tmp_path / "real")
    assert warm.script_path0("script", "link.py", str(tmp_path)) == str(tmp_path / "real")
    assert warm.script_path0("module", "pkg.train", str(tmp_path)) == str(tmp_path)


def test_exit_codes_follow_python(capsys):
    assert warm.exit_code(None) == 0
    assert warm.exit_code(SystemExit()) == 0
    assert warm.exit_code(SystemExit(3)) == 3
    assert warm.exit_code(SystemExit(256 + 7)) == 7  # the kernel keeps the low byte
    assert warm.exit_code(SystemExit("bad config")) == 1
    assert capsys.readouterr().err == "bad config\n"  # printed, as Python does
    assert warm.exit_code(RuntimeError("boom")) == 1


@pytest.fixture
def in_process(monkeypatch):
    """run_target in this process: keep pytest's argv, path, threads and atexit intact."""
    monkeypatch.setattr(warm, "_python_exit", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))


SCRIPT = """
import json, os, sys
import helper  # from the script's own directory, as `python t.py` finds it
out = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "helper": helper.X}
open(os.environ["OUT"], "w").write(json.dumps(out))
code = sys.argv[1]
if code == "raise":
    raise KeyError("missing")
if code != "none":
    sys.exit(int(code))
"""


def test_a_script_runs_as_main_with_its_argv_path_and_exit(
    tmp_path, in_process, monkeypatch, capsys
):
    import json

    d = tmp_path / "proj"
    d.mkdir()
    (d / "t.py").write_text(SCRIPT)
    (d / "helper.py").write_text("X = 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out.json"))
    assert warm.run_target(["--script", "proj/t.py", "none"]) == 0
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen == {
        "name": "__main__",
        "argv": ["proj/t.py", "none"],
        "path0": str(d),
        "helper": 42,
    }
    assert warm.run_target(["--script", "proj/t.py", "5"]) == 5
    assert warm.run_target(["--script", "proj/t.py", "raise"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'missing'" in err


def test_a_module_runs_as_main_with_the_cwd_on_the_path(tmp_path, in_process, monkeypatch):
    import json

    (tmp_path / "pkgw").mkdir()
    (tmp_path / "pkgw" / "__init__.py").write_text("")
    (tmp_path / "pkgw" / "train.py").write_text(
        SCRIPT.replace("import helper", "from pkgw import helper")
    )
    (tmp_path / "pkgw" / "helper.py").write_text("X = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out.json"))
    assert warm.run_target(["--module", "pkgw.train", "2"]) == 2
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["name"] == "__main__" and seen["helper"] == 7
    assert seen["argv"] == [str(tmp_path / "pkgw" / "train.py"), "2"]
    assert seen["path0"] == str(tmp_path)
    assert warm.run_target(["--module"]) == 2  # refused: one line, no traceback

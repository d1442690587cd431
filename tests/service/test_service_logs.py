"""Daemon logs: the journal reads a syslog priority per line (so `journalctl -p warning`
finds the warnings) and stamps the time itself; JSON lines for log shippers; bad levels
and formats are refused."""

from __future__ import annotations

import json
import logging
import os

import pytest

from rankguard.service.logs import LogConfigError, journal_stream, setup_logging


def lines_logged(stream_path, environ: dict[str, str], log_format: str | None = None) -> list[str]:
    with open(stream_path, "w") as stream:
        st = os.fstat(stream.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"} if environ else {}
        old = dict(os.environ)
        os.environ.pop("RANKGUARD_LOG_FORMAT", None)
        os.environ.update(env)
        try:
            setup_logging("debug", log_format, stream)
            log = logging.getLogger("rankguard.test")
            log.debug("d")
            log.info("i")
            log.warning("w")
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.exception("e")
        finally:
            os.environ.clear()
            os.environ.update(old)
            logging.getLogger().handlers.clear()
    return stream_path.read_text().splitlines()


def test_under_the_journal_each_line_carries_its_priority_and_no_timestamp(tmp_path):
    lines = lines_logged(tmp_path / "journal", {"journal": "yes"})
    assert lines[:3] == ["<7>rankguard.test: d", "<6>rankguard.test: i", "<4>rankguard.test: w"]
    assert lines[3] == "<3>rankguard.test: e"
    # the traceback's lines are entries of the same priority
    assert len(lines) > 4 and all(line.startswith("<3>") for line in lines[3:]), lines
    assert any("RuntimeError: boom" in line for line in lines)


def test_on_a_terminal_or_file_lines_carry_a_time_and_the_level(tmp_path):
    lines = lines_logged(tmp_path / "file", {})
    assert lines[2].endswith("rankguard.test WARNING: w") and not lines[2].startswith("<")


def test_journal_stream_must_name_this_very_stream(tmp_path):
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        st = os.fstat(b.fileno())
        assert not journal_stream(a, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert journal_stream(b, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not journal_stream(b, {"JOURNAL_STREAM": "garbage"})


def test_json_lines(tmp_path):
    lines = lines_logged(tmp_path / "json", {"journal": "yes"}, "json")  # JSON wins
    records = [json.loads(line) for line in lines]
    assert [r["level"] for r in records] == ["debug", "info", "warning", "error"]
    assert records[2]["logger"] == "rankguard.test" and records[2]["message"] == "w"
    assert "RuntimeError: boom" in records[3]["exception"]


@pytest.mark.parametrize("level,fmt", [("bogus", None), ("info", "xml")])
def test_bad_level_or_format_is_refused(level, fmt):
    with pytest.raises(LogConfigError):
        setup_logging(level, fmt)

"""Logging for the daemons: plain lines on a terminal, syslog priorities under journald,
JSON lines for log shippers.

Under systemd, stderr is connected to the journal and ``JOURNAL_STREAM`` names that stream
(device:inode). The journal stamps every line itself and reads a ``<N>`` prefix as the
line's syslog priority: without it every line is priority 6 (info) and
``journalctl -p warning`` misses the warnings. So when stderr *is* the journal stream,
lines are ``<4>rankguard.agent.daemon: message`` with no timestamp of their own.
``RANKGUARD_LOG_FORMAT=json`` writes one JSON object per line instead (time, level,
logger, message, and the exception when there is one).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
# logging level -> syslog priority (sd-daemon(3)): err, warning, info, debug
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}


class LogConfigError(ValueError):
    """A log level or format that does not exist (the daemons exit 2 on it)."""


def journal_stream(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """True if `stream` is the journal stream systemd connected (JOURNAL_STREAM)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class JournalFormatter(logging.Formatter):
    """`<priority>logger: message`: the journal adds the time and reads the priority."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 7 if record.levelno < logging.INFO else 6)
        # the journal makes each line an entry: every line of a traceback gets the priority
        text = super().format(record)
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def formatter_for(stream: TextIO, log_format: str, environ: dict[str, str] | None = None):
    if log_format == "json":
        return JsonFormatter()
    if journal_stream(stream, environ):
        return JournalFormatter()
    return logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s")


def setup_logging(level: str, log_format: str | None = None, stream: TextIO | None = None) -> None:
    """Configure the root logger for a daemon. Raises LogConfigError on a bad level or
    format (`RANKGUARD_LOG_FORMAT` when `log_format` is None)."""
    level = level.lower()
    if level not in LEVELS:
        raise LogConfigError(f"--log-level must be one of {', '.join(LEVELS)}, not {level!r}")
    log_format = (log_format or os.environ.get("RANKGUARD_LOG_FORMAT") or "text").lower()
    if log_format not in FORMATS:
        raise LogConfigError(
            f"RANKGUARD_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {log_format!r}"
        )
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter_for(stream, log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))

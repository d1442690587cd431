"""The package's version, from the installed distribution's metadata (pyproject.toml is the
one place it is written): the agent's and supervisor's `_info` metrics and `--version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("rankguard")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"

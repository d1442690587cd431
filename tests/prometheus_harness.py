"""A real Prometheus server (Debian's package) for integration tests: its own temporary
data directory, a loopback port, and helpers over its HTTP API."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest
from harness import free_port, http_json, wait_until


def prometheus_bin(name: str = "prometheus") -> str:
    """The binary's path; skipped where it is not installed, a failure in CI (scripts/test
    installs Debian's package there)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} missing in CI: scripts/test installs Debian's prometheus package")
        pytest.skip(f"{name} not installed (Debian package prometheus)")
    return path


class Prometheus:
    """`prometheus --config.file=CONFIG` with its TSDB under `workdir`; stop() ends it."""

    def __init__(self, config: Path, workdir: Path, extra_args: list[str] | None = None):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        self.log = workdir / "prometheus.log"
        with open(self.log, "w") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [prometheus_bin(), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn", *(extra_args or [])],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        try:
            wait_until(lambda: self.proc.poll() is None and self.get("/status/buildinfo")["status"] == "success",
                       60, "prometheus to start")  # fmt: skip
        except AssertionError:
            self.stop()
            raise AssertionError(
                f"prometheus did not start: {self.log.read_text()[-2000:]}"
            ) from None

    def get(self, path: str, **params) -> dict:
        url = self.api + path + ("?" + urllib.parse.urlencode(params) if params else "")
        return http_json(url, timeout=30)

    def query(self, expr: str, **params) -> list:
        return self.get("/query", query=expr, **params)["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self.get("/query_range", query=expr, start=start, end=end, step=step)["data"][
            "result"
        ]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

"""A real agent-side receiving socket for tests: decodes every datagram it gets."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from rankguard.contract.telemetry import TelemetryError, TelemetryRecord, decode


class TelemetrySink:
    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.records: list[TelemetryRecord] = []
        self.errors: list[TelemetryError] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            try:
                self.records.append(decode(data))
            except TelemetryError as exc:
                self.errors.append(exc)

    def train_records(self, rank: int) -> list[TelemetryRecord]:
        """Per-step records (those with timings) of one rank."""
        return [r for r in list(self.records) if r.rank == rank and r.step_seconds > 0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def __enter__(self) -> TelemetrySink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

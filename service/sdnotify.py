"""systemd's sd_notify protocol (READY, WATCHDOG, STATUS, STOPPING) without libsystemd."""

from __future__ import annotations

import os
import socket


def notify(message: str, environ=os.environ) -> bool:
    """Send one notification; False (and nothing else) when not run by systemd."""
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message.encode(), address)
        return True
    except OSError:
        return False


def watchdog_interval(environ=os.environ) -> float | None:
    """Half of WatchdogSec (systemd's advice), if the watchdog is on for this process."""
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6

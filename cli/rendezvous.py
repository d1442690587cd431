"""`rankguard rendezvous`: the job's rendezvous store, on the control node.

A torch c10d TCPStore server and nothing else. Every training node's torchrun reaches it
with `--rdzv-backend rankguard --rdzv-endpoint HOST:PORT` (trainer/rendezvous.py), so the
store does not live on, and is not lost with, any training node. It holds only
rendezvous state (membership, rounds, the round's rank-0 address): a restart loses it,
and the nodes fill it in again (see docs/architecture.md, "Rendezvous off the training
nodes").

A TCPStore server given a host still listens on every address, so the socket is made
here, bound to `--bind`, and handed to the store (`master_listen_fd`). The store itself
has no authentication: the launchers sign what they unpickle (trainer/rendezvous.py), and
docs/security.md says what a writer to the port can still do (disturb, not run code).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from datetime import timedelta
from typing import Annotated

import typer

Opt = typer.Option
DEFAULT_PORT = 29400


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """Something accepts connections at host:port (the health check `rankguard up` uses)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def torchrun_args(endpoint: str, job: str, secret_file: str | os.PathLike[str]) -> list[str]:
    """torchrun's flags for the job's rendezvous through `rankguard rendezvous` at
    `endpoint`, its state signed with the secret in `secret_file` (trainer/rendezvous.py)."""
    return ["--rdzv-backend=rankguard", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
            f"--rdzv-conf=secret_file={os.fspath(secret_file)}"]  # fmt: skip


def listening_socket(bind: str, port: int) -> socket.socket:
    """A TCP socket listening on `bind`:`port` ("" or "*": every address, IPv6 and IPv4 where
    the host has IPv6); OSError when the address is not usable."""
    if bind in ("", "*"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            address: tuple = ("::", port)
        except OSError:  # no IPv6 on this host
            sock, address = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)
    else:
        family, _, _, _, address = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a quick restart
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous(
    port: Annotated[
        int, Opt(help="TCP port (firewall it to the training nodes)", min=1, max=65535)
    ] = DEFAULT_PORT,
    bind: Annotated[
        str,
        Opt(
            help="address to listen on: 127.0.0.1 (this machine only), the control node's "
            "address on the training network, or * (every address)"
        ),
    ] = "*",
    log_level: Annotated[str, Opt(help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
) -> None:
    """Run the job's rendezvous store (a torch c10d TCPStore) until SIGTERM or SIGINT.

    Start it on the control node, beside the supervisor, and point every node's torchrun
    at it: `torchrun --rdzv-backend rankguard --rdzv-endpoint HOST:PORT --rdzv-id JOB ...`.
    Then losing any training node, the one with rank 0 included, leaves the job running on
    the rest. If this service restarts, the nodes reconnect and the job goes on.

    Exit codes: 0 stopped by SIGTERM/SIGINT; 2 bad option or the address is not usable.
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("rankguard.rendezvous")
    # Block the stop signals before any thread starts (torch's import starts one, the
    # store more), so they all inherit the mask and the main thread alone takes a signal
    # in sigwait: a thread with them unblocked took a SIGTERM as its default, death
    # without STOPPING=1 (seen once in 8 under load).
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        import torch.distributed as dist
    except ImportError:
        typer.echo("rankguard rendezvous: needs torch (pip install 'rankguard[trainer]')", err=True)
        raise typer.Exit(2) from None
    from rankguard.service.sdnotify import notify, watchdog_interval

    where = "every address" if bind in ("", "*") else bind
    try:
        sock = listening_socket(bind, port)
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=False,
            timeout=timedelta(seconds=30), master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except (OSError, RuntimeError, ValueError) as exc:  # in use, or not an address of ours
        typer.echo(f"rankguard rendezvous: cannot listen on {where} port {port}: {exc}", err=True)
        raise typer.Exit(2) from None
    log.info("rendezvous store listening on port %d (%s)", store.port, where)
    notify(f"READY=1\nSTATUS=rendezvous store on port {store.port}")
    ping = watchdog_interval()
    if ping is not None:  # a check that hangs must miss the ping, not hold up a stop for 30 s
        store.set_timeout(timedelta(seconds=max(1.0, ping)))
    while True:
        if ping is None:
            sig = signal.sigwait(stop)
            break
        info = signal.sigtimedwait(stop, ping)
        if info is not None:
            sig = info.si_signo
            break
        try:  # a round trip through the server: pinged only while it answers
            store.check(["rankguard.watchdog"])
        except RuntimeError as exc:
            log.error("the store does not answer: %s", exc)
            continue
        notify("WATCHDOG=1")
    notify("STOPPING=1")
    log.info("%s: stopping", signal.Signals(sig).name)
    del store

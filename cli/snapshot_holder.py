"""`rankguard snapshot-holder run|status|corrupt`: the per-node tier-0 snapshot holder."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..agent.snapshot_holder import DEFAULT_MAX_SNAPSHOT_BYTES
from ..contract import snapshots as wire

Opt = typer.Option

app = typer.Typer(
    no_args_is_help=True,
    help="Tier-0 checkpoints: a per-node process that holds the ranks' in-memory snapshots "
    "(they outlive the ranks) and replicates them to a peer holder.",
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"rankguard snapshot-holder: {message}", err=True)
    return typer.Exit(2)


@app.command("run")
def run(
    socket_path: Annotated[
        str, Opt("--socket", help="unix socket the local ranks use ($RANKGUARD_SNAPSHOT_HOLDER)")
    ] = None,
    bind: Annotated[
        str, Opt(help="also serve TCP on HOST:PORT, for a peer holder on another node")
    ] = None,
    peer: Annotated[
        str,
        Opt(
            help="the peer holder (socket path or HOST:PORT): every local snapshot is "
            "replicated there (ring: node i -> node i+1); a comma-separated list: the next "
            "one takes over while a peer fails (a lost node's successor)"
        ),  # fmt: skip
    ] = None,
    token_file: Annotated[
        Path,
        Opt(
            help="the cluster's snapshot token (owner-only file, >= 16 chars): TCP peers "
            "prove it by HMAC; needed with --bind or a HOST:PORT peer"
        ),  # fmt: skip
    ] = None,
    max_snapshot_bytes: Annotated[
        int, Opt(help="refuse one rank's snapshot larger than this [16 GiB]", min=1)
    ] = DEFAULT_MAX_SNAPSHOT_BYTES,
    max_keep: Annotated[
        int, Opt(help="upper bound on the ranks' --snapshot-keep (steps held per job)", min=1)
    ] = 8,
) -> None:
    """Hold snapshots until stopped (SIGTERM/SIGINT). Memory: per job, the newest KEEP
    steps (the ranks' --snapshot-keep) plus the newest complete one, locally and as replicas."""
    from ..agent.snapshot_holder import HolderServer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")  # fmt: skip
    address, token = None, None
    peers = [p.strip() for p in (peer or "").split(",") if p.strip()]
    try:
        if bind:
            family, address = wire.parse_address(bind)
            if family != wire.socket.AF_INET:
                raise ValueError(f"--bind {bind!r}: expected HOST:PORT")
        tcp_peer = any(wire.parse_address(p)[0] == wire.socket.AF_INET for p in peers)
        if token_file is not None:
            token = wire.read_token(token_file)
        elif bind or tcp_peer:
            raise ValueError("TCP (--bind or a HOST:PORT peer) needs --token-file")
    except ValueError as exc:
        raise _fail(str(exc)) from None
    socket_path = socket_path or wire.default_address()
    try:
        server = HolderServer(socket_path, address, peers, max_keep, token, max_snapshot_bytes)
    except (OSError, ValueError) as exc:
        raise _fail(f"cannot listen: {exc}") from None

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    where = " and ".join(
        x for x in (socket_path, address and f"{address[0]}:{server.tcp_port}") if x
    )
    typer.echo(f"snapshot holder on {where}; peer {peer or 'none'}", err=True)
    sys.stderr.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


def _ask(address: str | None, header: dict, token_file: Path | None = None) -> dict:
    address = address or wire.default_address()
    if not address:
        raise _fail("no holder: give --socket or set RANKGUARD_SNAPSHOT_HOLDER")
    try:
        token = wire.read_token(token_file) if token_file else None
        answer, _ = wire.request(address, header, token=token)
    except (ValueError, wire.WireError) as exc:  # bad address or token; the holder's reason
        raise _fail(str(exc)) from None
    except (OSError, EOFError) as exc:
        raise _fail(f"{address}: not answering ({exc})") from None
    return answer


@app.command("status")
def status(
    socket_path: Annotated[str, Opt("--socket", help="holder socket path or HOST:PORT")] = None,
    as_json: Annotated[bool, Opt("--json", help="the raw status object")] = False,
    token_file: Annotated[Path, Opt(help="the snapshot token, for a holder on TCP")] = None,
) -> None:
    """What a holder keeps: bytes, snapshots per job and step (complete or not), replication."""
    s = _ask(socket_path, {"op": "status"}, token_file)
    if as_json:
        typer.echo(json.dumps(s, indent=2))
        return
    typer.echo(f"holder pid {s['pid']}, {s['bytes']} bytes held, keep {s['keep'] or '-'}, "
               f"evicted {s['evicted']}, refused {s['refused'] or '-'}")  # fmt: skip
    for e in s["snapshots"]:
        state = "complete" if e["complete"] else "partial"
        typer.echo(f"  {e['job']} {e['kind']:7} step {e['step']:>8} ranks {e['ranks']} "
                   f"{state} {e['bytes']} bytes")  # fmt: skip
    r = s.get("replication")
    if r:
        typer.echo(f"  replication to {r['peer']}: sent {r['sent']} dropped {r['dropped']} "
                   f"pending {r['pending']} last error {r['last_error'] or '-'}")  # fmt: skip


@app.command("corrupt")
def corrupt(
    job: Annotated[str, Opt(help="job id")],
    step: Annotated[int, Opt(help="snapshot step", min=0)],
    rank: Annotated[int, Opt(help="rank", min=0)],
    socket_path: Annotated[str, Opt("--socket", help="holder socket path or HOST:PORT")] = None,
    replica: Annotated[bool, Opt(help="the replica copy, not the local one")] = False,
    token_file: Annotated[Path, Opt(help="the snapshot token, for a holder on TCP")] = None,
) -> None:
    """Fault injection: flip one byte of a held snapshot (a resume must refuse it)."""
    kind = "replica" if replica else "local"
    _ask(socket_path, {"op": "corrupt", "job": job, "step": step, "rank": rank, "kind": kind},
         token_file)  # fmt: skip
    typer.echo(f"corrupted {kind} snapshot of {job} step {step} rank {rank}")

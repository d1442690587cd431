"""Trainer configuration: one small dataclass per component, validated on construction.

The command line (`python -m rankguard.trainer --help`) is built from these, so a
bad value is refused before any process group or file is touched.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from .faults import KINDS as FAULT_KINDS
from .faults import FaultSpec, parse_fault_specs

# How the main thread waits for collectives (trainer/spin_wait.py); here, not there, as
# the configuration is read before torch is imported.
WAIT_MODES = ("block", "spin")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which and why."""


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1")
        if self.d_model % self.n_head:
            raise ConfigError("model.d_model must be divisible by model.n_head")

    def with_vocab(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(self.n_layer, self.n_head, self.d_model, self.seq_len, vocab_size)


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step, across all ranks
    micro_batch: int  # sequences per forward/backward on one rank
    lr: float
    warmup_steps: int


PRESETS: dict[str, Preset] = {
    # Fast on one CPU core: the test suite's model.
    "tiny": Preset(ModelConfig(2, 2, 64, 64, 256), 16, 4, 3e-3, 5),
    # GPT-2 small shape, ~124M parameters with a GPT-2-sized vocabulary.
    "small": Preset(ModelConfig(12, 12, 768, 1024, 50304), 256, 16, 6e-4, 200),
    # ~1.3B parameters: fits one 80 GB GPU with bf16 autocast and AdamW.
    "1b": Preset(ModelConfig(24, 16, 2048, 2048, 50304), 256, 8, 2e-4, 500),
}


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError("optim.lr must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError("optim.grad_clip must be >= 0 (0 disables clipping)")


@dataclass(frozen=True)
class BatchConfig:
    global_batch: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ConfigError("global and micro batch sizes must be >= 1")

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per step, so the global batch never depends on world size."""
        per_rank, rest = divmod(self.global_batch, world_size * self.micro_batch)
        if rest or per_rank < 1:
            raise ConfigError(
                f"global batch {self.global_batch} is not a multiple of world size {world_size}"
                f" x micro batch {self.micro_batch}; choose sizes that divide"
            )
        return per_rank


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Path | None
    every: int = 0  # steps between saves; 0 disables saving
    keep: int = 3  # validated checkpoints kept by retention; <= 0 keeps all
    load: bool = True  # resume from the newest validated checkpoint at start
    mode: str = "async"  # "sync": blocking dcp.save, the benchmark's baseline
    # HMAC key for the manifests (--ckpt-key-file or $RANKGUARD_CHECKPOINT_KEY_FILE); None:
    # plain SHA-256 (catches corruption, not tampering). Never printed.
    key: bytes | None = field(default=None, repr=False)
    backup: Path | None = None  # tier 2: validated checkpoints copied here in the background
    backup_keep: int = 3  # retention in the backup root; <= 0 keeps all
    backup_wait: float = 300.0  # at exit, wait at most this long for the last copy
    writer: str = "thread"  # async DCP write: in the save thread, or DCP's writer process

    def __post_init__(self) -> None:
        if self.backup is not None:
            if self.dir is None:
                raise ConfigError("--ckpt-backup needs --ckpt-dir")
            b, d = self.backup.absolute(), self.dir.absolute()
            if b == d or d in b.parents or b in d.parents:
                raise ConfigError("--ckpt-backup must be outside --ckpt-dir (and not hold it)")
        if self.writer not in ("thread", "process"):
            raise ConfigError("--ckpt-writer must be thread or process")
        if self.mode not in ("async", "sync"):
            raise ConfigError("--ckpt-mode must be async or sync")
        if self.every < 0:
            raise ConfigError("--ckpt-every must be >= 0")
        if self.every and self.dir is None:
            raise ConfigError("--ckpt-every needs --ckpt-dir")


@dataclass(frozen=True)
class SnapshotConfig:
    """Tier 0: in-memory snapshots in the node's holder (client/snapshots.py)."""

    every: int = 0  # steps between snapshots; 0 disables them
    keep: int = 2  # steps the holder keeps per job (plus the newest complete one)
    holder: str | None = None  # this node's holder: socket path or HOST:PORT
    peers: tuple[str, ...] = ()  # other holders searched at resume (a lost node's replica)
    token_file: Path | None = None  # the cluster's snapshot token, for holders on TCP

    def __post_init__(self) -> None:
        import socket

        from ..contract.snapshots import parse_address, read_token

        if self.every < 0:
            raise ConfigError("--snapshot-every must be >= 0")
        if self.keep < 1:
            raise ConfigError("--snapshot-keep must be >= 1")
        if self.every and not self.holder:
            raise ConfigError(
                "--snapshot-every needs a holder: --snapshot-holder or $RANKGUARD_SNAPSHOT_HOLDER"
                " (start one with `rankguard snapshot-holder run --socket PATH`)"
            )
        tcp = False
        for addr in (self.holder, *self.peers):
            if addr:
                try:
                    tcp |= parse_address(addr)[0] == socket.AF_INET
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
        if self.every and tcp and self.token_file is None:
            raise ConfigError(
                "a snapshot holder on HOST:PORT needs the snapshot token: --snapshot-token-file"
                " or $RANKGUARD_SNAPSHOT_TOKEN_FILE"
            )
        if self.every and self.token_file is not None:
            try:
                read_token(self.token_file)
            except ValueError as exc:
                raise ConfigError(f"--snapshot-token-file: {exc}") from None


@dataclass(frozen=True)
class TrainConfig:
    preset: str
    model: ModelConfig
    optim: OptimConfig
    batch: BatchConfig
    ckpt: CheckpointConfig
    steps: int
    seed: int = 1234
    data_dir: Path | None = None
    summary: Path | None = None
    job: str = "local"
    telemetry_socket: str | None = None
    log_every: int = 10
    fsdp: bool = False
    peak_flops: float | None = None
    deterministic: bool = False  # bit-identical resume on GPU too, at some speed
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)
    fault_file: str | None = None
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    data_workers: int = 0  # DataLoader worker processes (0: load in the training process)
    spike_skip: int = 8  # data steps skipped up to a loss spike after its rollback
    wait_mode: str = "block"  # "spin": collectives waited by busy-polling (an NCCL stand-in)
    pg_timeout: float | None = None  # the process groups' collective timeout (torch's default)

    def __post_init__(self) -> None:
        if self.wait_mode not in WAIT_MODES:
            raise ConfigError(f"--wait-mode ($RANKGUARD_WAIT_MODE) must be block or spin,"
                              f" not {self.wait_mode!r}")  # fmt: skip
        if self.wait_mode == "spin" and self.fsdp:
            # FSDP2 waits for its all-gathers and reduce-scatters inside its own hooks, in C++:
            # there is no place to poll them from
            raise ConfigError("--wait-mode spin works with DDP only, not with --fsdp")
        if self.pg_timeout is not None and not 0 < self.pg_timeout <= 86400:
            raise ConfigError("--pg-timeout must be in (0, 86400] seconds")
        if self.steps < 1:
            raise ConfigError("--steps must be >= 1")
        if not 0 <= self.data_workers <= 64:
            raise ConfigError("--data-workers must be between 0 and 64")
        if not 0 <= self.spike_skip <= 100_000:
            raise ConfigError("--spike-skip-batches must be between 0 and 100000")
        if self.log_every < 0:
            raise ConfigError("--log-every must be >= 0")


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(
        prog="python -m rankguard.trainer",
        description=(
            "rankguard's bundled GPT trainer. Launch with torchrun, e.g. "
            "`torchrun --nproc-per-node 2 --max-restarts 3 -m rankguard.trainer --preset tiny "
            "--steps 40 --ckpt-dir ckpt --ckpt-every 10`. Resumes from the newest validated "
            "checkpoint in --ckpt-dir at every (re)start."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to train (total)")
    p.add_argument("--global-batch", type=int, help="sequences per step across all ranks")
    p.add_argument("--micro-batch", type=int, help="sequences per forward/backward per rank")
    p.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--d-model", type=int, help="override the preset's model width")
    p.add_argument("--n-head", type=int, help="override the preset's attention heads")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint root directory")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--keep", type=int, default=3, help="validated checkpoints to keep (<=0: all)")
    p.add_argument(
        "--ckpt-mode",
        choices=("async", "sync"),
        default="async",
        help="async (default) blocks only for staging; sync blocks for the whole save",
    )
    p.add_argument(
        "--ckpt-key-file",
        type=Path,
        help="file with the secret key that signs and checks checkpoint manifests (HMAC); "
        "default $RANKGUARD_CHECKPOINT_KEY_FILE; none: SHA-256 only",
    )
    p.add_argument(
        "--ckpt-writer",
        choices=("thread", "process"),
        default="thread",
        help="async saves write in a low-priority thread (default) or in DCP's writer process",
    )
    p.add_argument(
        "--ckpt-backup",
        type=Path,
        help="backup tier: validated checkpoints are copied here in the background (another"
        " filesystem), verified, and resumed from when --ckpt-dir has none",
    )
    p.add_argument(
        "--backup-keep", type=int, default=3, help="checkpoints kept in --ckpt-backup (<=0: all)"
    )
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="tier 0: copy each rank's state into the node's snapshot holder every N steps"
        " (0: never); resume prefers it when newer than the newest disk checkpoint",
    )
    p.add_argument(
        "--snapshot-keep", type=int, default=2, help="snapshot steps the holder keeps [2]"
    )
    p.add_argument(
        "--snapshot-holder",
        default=None,
        help="this node's snapshot holder (socket path or HOST:PORT; default"
        " $RANKGUARD_SNAPSHOT_HOLDER)",
    )
    p.add_argument(
        "--snapshot-peers",
        default=None,
        help="comma-separated other holders searched at resume (default $RANKGUARD_SNAPSHOT_PEERS)",
    )
    p.add_argument(
        "--snapshot-token-file",
        type=Path,
        default=None,
        help="the cluster's snapshot token (owner-only file), for holders on HOST:PORT"
        " (default $RANKGUARD_SNAPSHOT_TOKEN_FILE)",
    )
    p.add_argument("--data", type=Path, help="token shards from `rankguard trainer prepare`")
    p.add_argument(
        "--data-workers",
        type=int,
        default=0,
        help="DataLoader worker processes loading batches ahead (0: in the training loop)",
    )
    p.add_argument(
        "--spike-skip-batches",
        type=int,
        default=8,
        help="after a loss spike's rollback, skip this many data steps up to the spike's [8]",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--summary", type=Path, help="rank 0 writes final step, loss, digest here")
    p.add_argument("--job", default=None, help="job id for telemetry (default: torchrun's run id)")
    p.add_argument(
        "--telemetry-socket",
        default=None,
        help="agent's Unix datagram socket ('off' disables; default: $RANKGUARD_TELEMETRY_SOCKET"
        " or /run/rankguard/telemetry.sock)",
    )
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints every N steps")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 fully_shard")
    p.add_argument(
        "--wait-mode",
        choices=WAIT_MODES,
        default=None,
        help="how the main thread waits for collectives: block (sleep in the kernel, as on"
        " gloo) or spin (busy-poll, using a core, as a rank waiting on NCCL does; DDP only);"
        " default $RANKGUARD_WAIT_MODE or block",
    )
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the process groups' collective timeout: a collective waiting longer fails (NCCL's"
        " watchdog aborts the rank); default torch's (10 min on NCCL, 30 min on gloo)",
    )
    p.add_argument(
        "--peak-flops",
        type=float,
        help="device peak FLOP/s for MFU (default: the datasheet's dense bf16 figure of a known"
        " GPU, else a measured matrix product)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace,"
        " math attention), so a resumed run's parameters match an uninterrupted run's bit for"
        " bit on a GPU too; slower. On the CPU runs are reproducible without it",
    )
    p.add_argument(
        "--fault-file",
        default=None,
        help="file of fault specs (one per line) re-read during training; default $RANKGUARD_FAULT_FILE",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject a fault (also $RANKGUARD_FAULTS, ';'-separated): KIND:step=N[:rank=R]"
        f"[:factor=F][:seconds=S][:restart=K|any]; KIND is {', '.join(FAULT_KINDS)}"
        " (docs/faults.md)",
    )
    return p


def _checkpoint_key(key_file: Path | None, environ) -> bytes | None:
    """The checkpoint key, read before any process group: a bad file is a one-line error."""
    from ..client.checkpoint_store import CheckpointError, resolve_key

    try:
        return resolve_key(key_file, environ)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None


class _CheckingParser(argparse.ArgumentParser):
    """argparse that raises its error (for check_args) instead of printing and exiting."""

    def error(self, message: str):
        raise ConfigError(message)


def check_args(argv: list[str], environ=os.environ) -> str | None:
    """What is wrong with the trainer's command line `argv`, as one line, or None: the
    checks the trainer makes at start, made before anything is started (`rankguard up`)."""
    try:
        config_from_args(argv, environ, parser_class=_CheckingParser)
    except ValueError as exc:  # ConfigError, FaultSpecError
        return str(exc)
    return None


def config_from_args(
    argv: list[str] | None = None, environ=os.environ, parser_class=argparse.ArgumentParser
) -> TrainConfig:
    from ..contract.telemetry import socket_path_from_env

    args = build_parser(parser_class).parse_args(argv)
    preset = PRESETS[args.preset]
    model = preset.model
    model = ModelConfig(
        n_layer=args.n_layer or model.n_layer,
        n_head=args.n_head or model.n_head,
        d_model=args.d_model or model.d_model,
        seq_len=args.seq_len or model.seq_len,
        vocab_size=model.vocab_size,
    )
    if args.data is not None:
        model = model.with_vocab(256)  # byte-level shards
    socket = args.telemetry_socket
    if socket is None:
        socket = socket_path_from_env(environ)
    elif socket in ("", "off"):
        socket = None
    fault_text = list(args.fault) + [s for s in environ.get("RANKGUARD_FAULTS", "").split(";") if s]
    return TrainConfig(
        preset=args.preset,
        model=model,
        optim=OptimConfig(
            lr=args.lr if args.lr is not None else preset.lr,
            warmup_steps=args.warmup_steps
            if args.warmup_steps is not None
            else preset.warmup_steps,
        ),
        batch=BatchConfig(
            global_batch=args.global_batch or preset.global_batch,
            micro_batch=args.micro_batch or preset.micro_batch,
        ),
        ckpt=CheckpointConfig(
            dir=args.ckpt_dir,
            every=args.ckpt_every,
            keep=args.keep,
            load=not args.no_resume,
            mode=args.ckpt_mode,
            key=_checkpoint_key(args.ckpt_key_file, environ) if args.ckpt_dir else None,
            backup=args.ckpt_backup,
            writer=args.ckpt_writer,
            backup_keep=args.backup_keep,
        ),
        steps=args.steps,
        seed=args.seed,
        data_dir=args.data,
        data_workers=args.data_workers,
        spike_skip=args.spike_skip_batches,
        summary=args.summary,
        job=args.job
        or environ.get("RANKGUARD_JOB")
        or environ.get("TORCHELASTIC_RUN_ID")
        or "local",
        telemetry_socket=socket,
        log_every=args.log_every,
        fsdp=args.fsdp,
        wait_mode=args.wait_mode or environ.get("RANKGUARD_WAIT_MODE") or "block",
        pg_timeout=args.pg_timeout,
        peak_flops=args.peak_flops,
        deterministic=args.deterministic,
        faults=parse_fault_specs(fault_text),
        fault_file=args.fault_file or environ.get("RANKGUARD_FAULT_FILE") or None,
        snapshot=SnapshotConfig(
            every=args.snapshot_every,
            keep=args.snapshot_keep,
            holder=args.snapshot_holder or environ.get("RANKGUARD_SNAPSHOT_HOLDER") or None,
            peers=tuple(
                p
                for p in (args.snapshot_peers or environ.get("RANKGUARD_SNAPSHOT_PEERS", "")).split(
                    ","
                )
                if p
            ),
            token_file=args.snapshot_token_file
            or (Path(t) if (t := environ.get("RANKGUARD_SNAPSHOT_TOKEN_FILE")) else None),
        ),
    )

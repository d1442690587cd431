"""The training program torchrun starts: parse -> build -> resume -> loop -> close."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..client import Reporter, StepTiming, flight_recorder
from . import announce
from .checkpoint import AsyncCheckpointer
from .config import ConfigError, TrainConfig, config_from_args
from .data import GlobalSampler, MemmapTokens, StepBatches, StepLoader, SyntheticTokens
from .distributed import DistInfo, agree_incarnation, init_distributed, unwrap, wrap_model
from .faults import FaultInjector
from .mfu import peak_flops_and_source
from .model import GPT, parameter_digest
from .snapshots import TierZero
from .spikes import HISTORY, data_step, is_spike, plan_skips, read_spikes, record_spike
from .spin_wait import all_reduce
from .startup_trace import StartupTrace

log = logging.getLogger("rankguard.trainer")


def lr_schedule(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate: linear warm-up, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


STEADY_AFTER = 3  # steps left out of steady-state speed


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def digest_expectation(device_type: str, deterministic: bool) -> dict:
    """Whether a resumed run's parameter digest should equal an uninterrupted run's."""
    if deterministic:
        note = "deterministic kernels: a resumed run matches an uninterrupted one bit for bit"
        return {"deterministic": True, "digest_reproducible": True, "digest_note": note}
    if device_type == "cpu":
        note = "CPU kernels sum in a fixed order: resumed runs match bit for bit"
        return {"deterministic": False, "digest_reproducible": True, "digest_note": note}
    note = (
        "not expected to match an uninterrupted run: without --deterministic, CUDA kernels"
        " (fused attention backward, some reductions) may accumulate in a different order"
        " from run to run"
    )
    return {"deterministic": False, "digest_reproducible": False, "digest_note": note}


def enable_determinism() -> None:
    """Deterministic algorithms everywhere; cuBLAS needs its workspace fixed before the
    first handle is created, so call this before anything touches CUDA."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas)


class Trainer:
    def __init__(self, cfg: TrainConfig, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.incarnation = agree_incarnation(cfg.ckpt.dir, info)
        self.faults = FaultInjector(
            cfg.faults, info.rank, info.restart_count, cfg.fault_file, self.incarnation
        )
        self.phase = "init"
        self.step = 0
        self.last_loss: float | None = None
        self.ckpt: AsyncCheckpointer | None = None
        # The public client builds and sends the records (announcing "init" now); the
        # trainer drives its step timer itself (micro-batches, checkpoint blocking, faults).
        announce.stop()  # the start-up announcement's beats end here
        self.telemetry = Reporter(
            job=cfg.job,
            socket_path=cfg.telemetry_socket,
            device=info.device,
            restart=self.incarnation,
            # the trainer announces its own phases; inside a long one (a checkpoint load, a
            # save it waits for) it beats each second while the process moves
            heartbeat_seconds=1.0,
            heartbeat_progress=True,
            environ={"RANK": str(info.rank), "LOCAL_RANK": str(info.local_rank),
                     "WORLD_SIZE": str(info.world_size)},
        )  # fmt: skip

        if cfg.data_dir is not None:
            self.dataset = MemmapTokens(cfg.data_dir, cfg.model.seq_len)
        else:
            self.dataset = SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_len, cfg.seed)
        self.sampler = GlobalSampler(len(self.dataset), cfg.batch.global_batch, cfg.seed)
        self.accum = cfg.batch.accum_steps(info.world_size)
        self.batches = StepBatches(
            self.dataset, self.sampler, info.rank, info.world_size, self.accum,
            cfg.batch.micro_batch, self.faults,
        )  # fmt: skip
        self.loader: StepLoader | None = None  # opened at the resumed step (run)
        # Loss spikes (trainer/spikes.py): data steps skipped, this incarnation's losses,
        # and whether it saw a spike (then it validates no more checkpoints).
        self.data_skips: list[int] = []
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.judged_step = 0
        self.spiked_at: int | None = None

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.raw_model = GPT(cfg.model).to(info.device)
        self.flops_per_token = self.raw_model.flops_per_token()
        self.timer = self.telemetry.timer
        self.spin = cfg.wait_mode == "spin"
        self.model = wrap_model(self.raw_model, info, cfg.fsdp, self.timer, cfg.wait_mode)
        self.optim = build_optimizer(self.model, cfg)
        o = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optim, lambda s: lr_schedule(s, cfg.steps, o.warmup_steps, o.min_lr_ratio)
        )
        self.ckpt = AsyncCheckpointer(cfg.ckpt, info, self.faults) if cfg.ckpt.dir else None
        self.snap = (
            TierZero(cfg.snapshot, info, cfg.job, sharded=cfg.fsdp) if cfg.snapshot.every else None
        )
        self.resume_source: str | None = None  # holder, replica@ADDR or disk
        self.resume_sources: list[str | None] = []  # every rank's, with tier 0
        self.peak_flops, self.peak_flops_source = peak_flops_and_source(info.device, cfg.peak_flops)
        self.telemetry.flops_per_token = self.flops_per_token  # for MFU
        self.telemetry.peak_flops = self.peak_flops
        self._settle_ddp_buckets()
        self.resumed_from: int | None = None
        self._pending_loss: dict[int, torch.Tensor] = {}
        self._natural_compute = 0.0  # last step's fwd+bwd per micro-batch, without injected delay
        self.checkpoint_saves = 0
        self.checkpoint_block_seconds = 0.0
        self.train_seconds = 0.0
        self.steps_trained = 0
        # This incarnation's (step, data wait) seconds per step, for steady-state speed.
        self.step_times: list[tuple[float, float]] = []

    def _settle_ddp_buckets(self) -> None:
        """One zero-gradient forward/backward, so every step of every incarnation runs with
        DDP's rebuilt buckets. DDP reorders its buckets after the first backward; with 3+
        ranks the all-reduce's summation order depends on an element's place in its
        bucket, so a resumed run's first step (initial layout) was not bit-identical to
        the same step in an uninterrupted run (rebuilt layout). No data, RNG or optimizer
        state is touched."""
        if self.cfg.fsdp or self.info.world_size < 3:
            return
        m = self.cfg.model
        x = torch.zeros((1, m.seq_len), dtype=torch.long, device=self.info.device)
        with self._kernels():
            (self.model(x, x) * 0.0).backward()
        self.optim.zero_grad(set_to_none=True)

    def _kernels(self) -> contextlib.ExitStack:
        """The forward/backward context: bf16 autocast on a GPU; with --deterministic, the
        math attention backend (the fused backends' backward passes may accumulate in a
        different order from run to run)."""
        stack = contextlib.ExitStack()
        if self.info.device.type == "cuda":
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        if self.cfg.deterministic:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack

    # -- telemetry ------------------------------------------------------------------
    def _sync_telemetry(self) -> None:
        """What the next record carries from the trainer's state (the reporter builds it)."""
        rg = self.telemetry
        rg.last_step, rg.current_phase, rg.last_loss = self.step, self.phase, self.last_loss
        newest = self.ckpt.newest_validated if self.ckpt else None
        if newest is not None:  # async saves commit in the background
            rg.checkpoint_saved(newest)

    def send_heartbeat(self, phase: str | None = None) -> None:
        """A record without step timings: announces a phase change before long work."""
        if phase:
            self.phase = phase
        self._sync_telemetry()
        self.telemetry.heartbeat()  # never blocks or raises

    def _report(self, timings: list[StepTiming]) -> None:
        tokens = self.accum * self.cfg.batch.micro_batch * self.cfg.model.seq_len
        for t in timings:
            loss = self._pending_loss.pop(t.step).item()
            self._judge_loss(t.step, loss)
            self.last_loss = loss
            self.step_times.append((t.step_seconds, t.data_wait_seconds))
            self._sync_telemetry()
            self.telemetry.report(t, loss, tokens)
            every = self.cfg.log_every
            if self.info.rank == 0 and every and (t.step % every == 0 or t.step == self.cfg.steps):
                log.info(
                    "step %d loss %.4f step %.3fs data %.3fs compute %.3fs comm %.3fs (ratio %.2f)",
                    t.step, loss, t.step_seconds, t.data_wait_seconds, t.compute_seconds,
                    t.comm_seconds, t.comm_compute_ratio,
                )  # fmt: skip

    # -- resume ---------------------------------------------------------------------
    def resume(self) -> None:
        if not ((self.ckpt or self.snap) and self.cfg.ckpt.load):
            if self.snap:  # --no-resume: this job's older snapshots are not its past
                self.snap.forget_after(0)
            return
        self.send_heartbeat("checkpoint_load")
        with self.telemetry.phase("checkpoint_load"):  # progress beats while loading
            if self.snap:  # every tier: tier 0 (in memory), then the disk
                state, self.resume_source = self.snap.resume(self.model, self.optim, self.ckpt)
                self.snap.forget_after(state["step"] if state else 0)
                # where every rank's state came from (a lost node's replica is on some rank only)
                self.resume_sources = [None] * self.info.world_size
                dist.all_gather_object(self.resume_sources, self.resume_source)
            else:
                state = self.ckpt.resume(self.model, self.optim)
                self.resume_source = "disk" if state else None
            self.faults.load_delay(state["step"] if state else None)
        self._plan_skips(state)
        if state is None:
            return
        if state["global_batch"] != self.cfg.batch.global_batch:
            raise ConfigError(
                f"checkpoint step {state['step']} was trained with global batch"
                f" {state['global_batch']}, not {self.cfg.batch.global_batch}"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = self.resumed_from = state["step"]
        self.last_loss = state["loss"]
        if state["same_world"]:
            torch.set_rng_state(state["rng_cpu"])
            if state["rng_cuda"] is not None and self.info.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng_cuda"], self.info.device)
        else:  # a new layout: a fresh, still deterministic stream per rank
            torch.manual_seed(self.cfg.seed + 7919 * self.info.rank + self.step)
        if self.info.rank == 0:
            log.info(
                "resumed from step %d of %s (saved at world size %s, now %d, accumulation %d)",
                self.step, self.resume_source, "same" if state["same_world"] else "other",
                self.info.world_size, self.accum,
            )  # fmt: skip

    def _plan_skips(self, state: dict | None) -> None:
        """The data steps to skip from here: the checkpoint's, plus the window before each
        spike recorded past its data position (the same on every rank: same file, same
        checkpoint)."""
        if not self.cfg.ckpt.dir:
            return
        saved = list(state.get("data_skips", [])) if state else []
        resumed = state["step"] if state else 0
        spikes = read_spikes(self.cfg.ckpt.dir)
        self.data_skips = plan_skips(saved, spikes, self.cfg.spike_skip, resumed)
        new = sorted(set(self.data_skips) - set(saved))
        self.telemetry.data_skipped(new)  # the supervisor's incident says what was skipped
        if new and self.info.rank == 0:
            log.warning(
                "loss spike at data step(s) %s: skipping data steps %s after the rollback to"
                " step %d", sorted(d for d in spikes if d in new), new, resumed,
            )  # fmt: skip

    def trainer_state(self) -> dict:
        cuda = self.info.device.type == "cuda"
        return {
            "step": self.step,
            "global_batch": self.cfg.batch.global_batch,
            "world_size": self.info.world_size,
            "loss": self.last_loss,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(self.info.device) if cuda else None,
            "data_skips": list(self.data_skips),
        }

    # -- the loop -------------------------------------------------------------------
    def train_step(self, step: int) -> None:
        cfg, info, timer = self.cfg, self.info, self.timer
        self.faults.at_step_start(step)
        timer.comm_delay_seconds = self.faults.comm_delay(step)
        timer.begin(step)

        # Data wait: blocked in next() until the step's batches are there (a DataLoader's
        # workers with nothing ready, or the load itself without workers).
        data_start = time.perf_counter()
        batches = [
            tuple(t.to(info.device, non_blocking=True) for t in pair) for pair in next(self.loader)
        ]
        timer.host("data_wait", time.perf_counter() - data_start)

        timer.mark("compute_start")
        compute_start = time.perf_counter()
        injected = 0.0  # seconds of a `slow` fault's sleep, not part of the natural time
        total = torch.zeros((), device=info.device)
        poison = self.faults.poison_factor(data_step(step, self.data_skips))
        for k, (x, y) in enumerate(batches):
            last = k == self.accum - 1
            with self._grad_sync(last), self._kernels():
                loss = self.model(x, y)
                if self.faults.corrupt_loss(step):
                    loss = loss * float("nan")
                if poison != 1.0:  # a bad batch: its loss (and gradient) spikes
                    loss = loss * poison
                injected += self.faults.slow_compute(step, self._natural_compute)
                (loss / self.accum).backward()
            total += loss.detach() / self.accum
        timer.mark("backward_end")
        self._natural_compute = (time.perf_counter() - compute_start - injected) / self.accum
        if self.ckpt:  # the save in flight must have copied the weights before they change
            self._checkpoint_block(self.ckpt.wait_staged())
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.scheduler.step()
        timer.mark("optimizer_end")
        self._pending_loss[step] = total
        self.step = step

        # a scheduled save, or one the supervisor asked for (predictive drain: a failing
        # GPU leaves at the job's next checkpoint; every rank is asked for the same step)
        ckpt_due = bool(self.ckpt and (self.ckpt.due(step) or self.telemetry.save_requested(step)))
        snap_due = bool(self.snap and self.snap.due(step))
        if (ckpt_due or snap_due) and self._loss_finite_everywhere(total):
            self.last_loss = float(total)
            state = self.trainer_state()
            if snap_due:  # tier 0 first: it is the copy a fault soonest needs
                self._checkpoint_block(self.snap.save(step, self.model, self.optim, state))
            if ckpt_due:
                self.send_heartbeat("checkpoint_save")
                with self.telemetry.phase("checkpoint_save"):  # beats while a save moves
                    self._checkpoint_block(self.ckpt.save(step, self.model, self.optim, state))
                self.checkpoint_saves += 1
                self.phase = "train"
        timer.end()
        self._report(timer.ready())

    def _checkpoint_block(self, seconds: float) -> None:
        self.timer.host("checkpoint_block", seconds)
        self.checkpoint_block_seconds += seconds

    def _grad_sync(self, enabled: bool):
        """Gradient reduction only on the last micro-batch of a step."""
        if hasattr(self.model, "no_sync"):  # DDP
            return contextlib.nullcontext() if enabled else self.model.no_sync()
        self.model.set_requires_gradient_sync(enabled)  # FSDP2
        return contextlib.nullcontext()

    def _judge_loss(self, step: int, loss: float) -> None:
        """Once per step, in order: a spike is recorded for the restart to skip its data."""
        if step <= self.judged_step:
            return
        self.judged_step = step
        if is_spike(self.losses, loss) and self.cfg.ckpt.dir:
            d = data_step(step, self.data_skips)
            record_spike(self.cfg.ckpt.dir, d, step, loss, self.info.rank)
            if self.spiked_at is None:
                self.spiked_at = step
            log.error(
                "step %d (data step %d): loss spike %.4f on rank %d; no checkpoint is validated"
                " after it in this incarnation", step, d, loss, self.info.rank,
            )  # fmt: skip
        if math.isfinite(loss):
            self.losses.append(loss)

    def _loss_finite_everywhere(self, loss: torch.Tensor) -> bool:
        """Never checkpoint a state that already holds bad numerics or a loss spike
        (agreed by all ranks). Losses not yet reported are judged now (read a step late
        on a GPU), so a spike one step before a save is not saved."""
        for s in sorted(self._pending_loss):
            self._judge_loss(s, float(self._pending_loss[s]))
        ok = math.isfinite(float(loss)) and self.spiked_at is None
        flag = torch.tensor([1.0 if ok else 0.0])
        all_reduce(flag, op=dist.ReduceOp.MIN, spin=self.spin)  # main thread: the default group
        if flag.item() < 1 and self.info.rank == 0:
            log.error("step %d: non-finite loss or a loss spike, checkpoint skipped", self.step)
        return flag.item() >= 1

    def run(self, trace: StartupTrace | None = None) -> dict:
        trace = trace or StartupTrace(path="")
        self.resume()
        trace.mark("resumed")
        self.phase = "train"
        self.send_heartbeat()
        first_step, start = self.step, time.perf_counter()
        data_steps = [
            data_step(t, self.data_skips) for t in range(self.step + 1, self.cfg.steps + 1)
        ]
        self.loader = StepLoader(
            self.batches, data_steps, self.cfg.data_workers,
            pin_memory=self.info.device.type == "cuda",
        )  # fmt: skip
        for step in range(self.step + 1, self.cfg.steps + 1):
            self.train_step(step)
            if step == first_step + 1:
                trace.mark("first_step")
        self.loader.close()
        self._report(self.timer.ready(flush=True))
        if self.ckpt:
            self.send_heartbeat("checkpoint_save")
            with self.telemetry.phase("checkpoint_save"):
                self.ckpt.close()
        if self.snap:
            self.snap.close()
        self.train_seconds = time.perf_counter() - start
        self.steps_trained = self.step - first_step
        self.phase = "done"
        self._sync_telemetry()
        self.telemetry.close()  # announces "done"
        return self.summary()

    def summary(self) -> dict:
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )  # a collective under FSDP: every rank calls it
        loss = torch.tensor([self.last_loss if self.last_loss is not None else float("nan")])
        all_reduce(loss, spin=self.spin)
        return {
            "final_step": self.step,
            "final_loss": loss.item() / self.info.world_size,
            "param_digest": parameter_digest(full.items()),
            "world_size": self.info.world_size,
            "global_batch": self.cfg.batch.global_batch,
            "accum_steps": self.accum,
            "resumed_from": self.resumed_from,
            "restart_count": self.info.restart_count,
            "incarnation": self.incarnation,
            "num_params": unwrap(self.model).num_params(),
            "newest_validated_checkpoint": self.ckpt.newest_validated if self.ckpt else None,
            "checkpoint_failures": self.ckpt.failures if self.ckpt else 0,
            "checkpoint_saves": self.checkpoint_saves,
            "checkpoint_block_seconds": self.checkpoint_block_seconds,
            **(self.ckpt.stats() if self.ckpt else {}),
            "resume_source": self.resume_source,
            "resume_sources": self.resume_sources,
            "data_skips": self.data_skips,
            **(self.snap.stats() if self.snap else {"snapshot_saves": 0}),
            "steps_trained": self.steps_trained,
            "train_seconds": self.train_seconds,
            "tokens_per_second": self.steps_trained
            * self.cfg.batch.global_batch
            * self.cfg.model.seq_len
            / max(self.train_seconds, 1e-9),
            "telemetry_sent": self.telemetry.sent,
            "telemetry_dropped": self.telemetry.dropped,
            **self.speed(),
            **digest_expectation(self.info.device.type, self.cfg.deterministic),
        }

    def speed(self) -> dict:
        """Steady-state speed: medians over the steps after the first few (allocator warm-up,
        kernel selection, DDP's bucket rebuild), and MFU against the peak this run used."""
        steady = self.step_times[STEADY_AFTER:] or self.step_times

        def median(values: list[float]) -> float:
            return sorted(values)[len(values) // 2] if values else 0.0

        step = median([s for s, _ in steady])
        tokens = self.cfg.batch.global_batch * self.cfg.model.seq_len / self.info.world_size
        tps = tokens / step if step else 0.0
        # the mean, not the median, for what checkpoints cost: a save's blocking lands on
        # one step in N, which a median never sees
        mean = sum(s for s, _ in steady) / len(steady) if steady else 0.0
        return {
            "device": device_name(self.info.device),
            "median_step_seconds": step,
            "steady_steps": len(steady),
            "mean_step_seconds": mean,
            "steady_tokens_per_second": tokens * self.info.world_size / mean if mean else 0.0,
            "median_data_wait_seconds": median([d for _, d in steady]),
            "steady_tokens_per_second_per_rank": tps,
            "peak_memory_bytes": peak_memory_bytes(self.info.device),
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_flops_source,
            "mfu": self.flops_per_token * tps / self.peak_flops if tps else 0.0,
        }


def main(argv: list[str] | None = None) -> int:
    announce.announce(argv)  # a warm-started worker (the cold path announced before imports)
    trace = StartupTrace()
    trace.mark("imported")
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {os.environ.get('RANK', '0')}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_from_args(argv)
    except ValueError as exc:  # ConfigError, FaultSpecError
        print(f"rankguard trainer: {exc}", file=sys.stderr)
        return 2
    if cfg.deterministic:
        enable_determinism()
    flight_recorder.enable()  # before the process group: its wavefront names a hang's culprit
    info = init_distributed(timeout=cfg.pg_timeout)
    trace.mark("process_group")
    ended = False
    try:
        trainer = Trainer(cfg, info)
        trace.job, trace.incarnation = cfg.job, trainer.incarnation
        trace.mark("built")
        summary = trainer.run(trace)
        if info.rank == 0:
            log.info(
                "done: step %d loss %.4f digest %s", summary["final_step"], summary["final_loss"],
                summary["param_digest"][:16],
            )  # fmt: skip
            if cfg.summary:
                cfg.summary.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(f"{cfg.summary}.tmp")
                tmp.write_text(json.dumps(summary, indent=2) + "\n")
                os.replace(tmp, cfg.summary)
        ended = True
    finally:
        # On an exception the group is left to the process's exit: destroying it here
        # closes the peers' connections while this rank still lives (printing its
        # traceback), a peer then errors out and exits first, and is taken for the culprit.
        if ended and dist.is_initialized():
            dist.destroy_process_group()
    return 0

"""Asynchronous, validated checkpoints with torch.distributed.checkpoint (DCP).

Save (every `--ckpt-every` steps, at most one in flight):
  main thread   wait for the previous save; write this rank's small trainer-state file
                into `step-N.partial/`; hand model + optimizer state to the stager.
  staging       a background copy of the tensors (device -> host); the trainer waits for
                it only just before the next optimizer step changes the weights
                (`wait_staged`). Training blocks only for these two waits.
  our thread    at the lowest best-effort I/O priority: `dcp.save` of the
                staged copy (this rank's shard files, rank 0 the metadata), then fsync +
                checksum of this rank's own files (CRC-32, or SHA-256 with a key); all ranks
                exchange the entries over a dedicated gloo group; rank 0 commits (manifest
                written and synced, then the atomic rename `step-N.partial` -> `step-N`),
                applies retention and hands the checkpoint to the backup worker (tier 2,
                `--ckpt-backup`); every rank then learns the newest validated step.
So a checkpoint is visible as committed only after every rank's data is durable.
Why one thread rather than `dcp.async_save`: measured on 2 CPU ranks
(bench/checkpoint_overhead.py), its separate write and hash threads took CPU from the
training threads of both ranks, which wait for each other every step. The thread keeps
normal CPU priority: at nice 19 (tried) a busy CPU starved it, so a checkpoint was not
committed before a fault five steps later and the restart lost its whole interval. The
backup tier's copies, which nothing waits for, run at nice 19.

Resume (at every start, every torchrun restart): rank 0 picks the newest validated
checkpoint across the tiers (`checkpoint_store.select_resume_tiers`: disk, then backup),
quarantining anything incomplete or corrupt on the way in its own tier, and broadcasts
the choice so all ranks load the same one. DCP reshards on load, so a different world size
works; per-rank RNG state is restored only when the world size is unchanged.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..client import checkpoint_store as store
from .config import CheckpointConfig
from .distributed import DistInfo

log = logging.getLogger("rankguard.trainer.checkpoint")

# Before torch 2.13, dcp.async_save closes a caller's stager once that save's upload ends
# (its staging tables are cleared), so the next save through it fails with
# KeyError(<class 'type'>): found on an H100 with torch 2.11. From 2.13 the caller owns the
# stager, and one stager reuses its pinned host buffers from save to save.
STAGER_REUSABLE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _done(error: BaseException | None = None) -> Future:
    """A finished future: a save that completed, or failed with `error`, on this thread."""
    done: Future = Future()
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
    return done


class _AlreadyStaged(AsyncStager):
    """Hands DCP a state the trainer's stager copied already (no second copy)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _trainer_state_name(rank: int) -> str:
    return f"trainer-state-rank{rank}.pt"


def _own_files(step_dir: Path, rank: int) -> list[Path]:
    files = sorted(step_dir.glob(f"__{rank}_*.distcp")) + [step_dir / _trainer_state_name(rank)]
    if rank == 0:
        files.append(step_dir / ".metadata")
    return files


class AsyncCheckpointer:
    def __init__(self, cfg: CheckpointConfig, info: DistInfo, faults):
        self.cfg = cfg
        self.info = info
        self.faults = faults
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="rankguard-ckpt",
            initializer=store.lower_priority,
            initargs=(False,),
        )
        self._inflight: Future | None = None
        self._staging: Future | None = None
        self._stager = self._new_stager() if STAGER_REUSABLE else None
        self.newest_validated: int | None = None  # as known to this rank
        self.failures = 0
        self._verified: set[tuple[int, int]] = set()  # identities of checkpoints hashed here
        self.algorithm = store.checksum_for(cfg.key)
        # seconds spent by the save thread, by part: where a save's time goes (the benchmark)
        self.times = {"stage": 0.0, "write": 0.0, "hash": 0.0, "commit": 0.0}
        self.resumed_tier: str | None = None
        self.backup: store.BackupWorker | None = None
        if cfg.backup is not None and info.rank == 0:  # rank 0 commits, so rank 0 copies
            self.backup = store.BackupWorker(
                cfg.backup,
                keep=cfg.backup_keep,
                key=cfg.key,
                status_path=cfg.dir / store.BACKUP_STATUS_NAME,
            )

    def _new_stager(self) -> DefaultStager:
        cuda = self.info.device.type == "cuda"
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )

    @property
    def root(self) -> Path:
        return self.cfg.dir

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and step % self.cfg.every == 0

    # -- save ---------------------------------------------------------------------
    def save(self, step: int, model, optim, trainer_state: dict) -> float:
        """Start an asynchronous save of `step`; returns the seconds training blocked.

        A save that fails (a full disk, say) is counted and logged, never raised: training
        goes on, the newest validated checkpoint stays, and the next due save tries again."""
        start = time.perf_counter()
        self.wait()
        partial = self.root / f"{store.step_dir_name(step)}.partial"
        try:
            store.ensure_partial_dir(self.root, step)  # never a symlink or another user's dir
            torch.save(trainer_state, partial / _trainer_state_name(self.info.rank))
            prepared = None
        except Exception as exc:  # OSError, or torch.save's RuntimeError on a full disk
            prepared = f"rank {self.info.rank}: {exc!r}"
        # Every rank must take part in DCP's collectives, or none: agree first.
        if not self._all_ranks_ready(prepared is None):
            self.failures += 1
            log.error("checkpoint of step %d skipped: %s", step, prepared or "another rank failed")
            return time.perf_counter() - start
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        writer = dcp.FileSystemWriter(partial, sync_files=True)
        try:
            if self.cfg.mode == "sync":  # the baseline the benchmark compares against
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer, process_group=self.info.ckpt_group)
                self.times["write"] += time.perf_counter() - t0
                self._finish(step, partial, _done())
                return time.perf_counter() - start
            stager = self._stager or self._new_stager()
            staged = stager.stage(state)  # a Future: the copy runs in the stager's thread
        except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
            self._finish(step, partial, _done(exc))  # reported to rank 0 like a failed write
            return time.perf_counter() - start
        self._staging = staged
        self._inflight = self._executor.submit(self._write_and_finish, step, partial, staged,
                                               writer, None if self._stager else stager)  # fmt: skip
        return time.perf_counter() - start

    def _write_and_finish(self, step, partial: Path, staged: Future, writer, own_stager) -> None:
        """The save thread (low priority): write the staged copy, then checksum and commit."""
        t0 = time.perf_counter()
        try:
            state = staged.result()
            t1 = time.perf_counter()
            self.times["stage"] += t1 - t0
            if self.cfg.writer == "process":
                # DCP's writer process (spawned once, from this low-priority thread, so at
                # its priority): the write holds no GIL of the training process
                dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self.info.ckpt_group,
                    async_stager=_AlreadyStaged(),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                ).result()
            else:
                dcp.save(state, storage_writer=writer, process_group=self.info.ckpt_group)
            self.times["write"] += time.perf_counter() - t1
            upload = _done()
        except (Exception, CheckpointException) as exc:
            upload = _done(exc)
        finally:
            if own_stager is not None:  # torch < 2.13: a stager per save
                own_stager.close()
        return self._finish(step, partial, upload)

    def _all_ranks_ready(self, ready: bool) -> bool:
        flag = torch.tensor([1 if ready else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.info.ckpt_group)
        return bool(flag.item())

    def wait_staged(self) -> float:
        """Block until the in-flight save has copied the weights; call before they change."""
        if self._staging is None:
            return 0.0
        start = time.perf_counter()
        self._staging.result()
        self._staging = None
        return time.perf_counter() - start

    def _finish(self, step: int, partial: Path, upload: Future) -> int | None:
        info = self.info
        try:
            upload.result()
            delay = self.faults.ckpt_delay(step)
            if delay:
                time.sleep(delay)  # fault hook: slow storage
            t0 = time.perf_counter()
            entries = []
            for path in _own_files(partial, info.rank):  # durable (fsync), then checksummed
                entry = store.hash_file(path, fsync=True, algorithm=self.algorithm)
                entries.append(entry.to_dict())
            self.times["hash"] += time.perf_counter() - t0
            mine = ("ok", entries)
        except (Exception, CheckpointException) as exc:  # reported to rank 0: no commit
            mine = ("error", f"rank {info.rank}: {exc!r}")
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, mine, group=info.ckpt_group)
        outcome: list = [None]
        t0 = time.perf_counter()
        if info.rank == 0:
            errors = [msg for status, msg in gathered if status == "error"]
            if errors:
                outcome[0] = ("error", "; ".join(errors))
            else:
                try:
                    files = [store.FileEntry.from_dict(e) for _, lst in gathered for e in lst]
                    final = store.commit(
                        partial,
                        step,
                        info.world_size,
                        files,
                        extra={
                            "trainer_state_files": [
                                _trainer_state_name(r) for r in range(info.world_size)
                            ]
                        },
                        key=self.cfg.key,
                    )
                    # every rank hashed its files just now: retention need not reread them
                    self._verified.add(store.identity(final))
                    removed = store.apply_retention(
                        self.root, self.cfg.keep, key=self.cfg.key, verified=self._verified
                    )
                    if removed:
                        log.info("retention removed %s", ", ".join(p.name for p in removed))
                    store.quarantine_failed_saves(self.root, step, key=self.cfg.key)
                    if self.backup is not None:
                        self.backup.submit(final)  # never blocks: copied in its own thread
                    outcome[0] = ("ok", step)
                except Exception as exc:  # e.g. ENOSPC: stays .partial, never validated
                    outcome[0] = ("error", f"commit failed: {exc!r}")
        dist.broadcast_object_list(outcome, src=0, group=info.ckpt_group)
        self.times["commit"] += time.perf_counter() - t0
        status, value = outcome[0]
        if status == "ok":
            self.newest_validated = value
            return value
        self.failures += 1
        log.error("checkpoint of step %d not committed: %s", step, value)
        return None

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed."""
        self.wait_staged()
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
        # the last checkpoint's copy, unless the target hangs
        if self.backup is not None and not self.backup.close(timeout=self.cfg.backup_wait):
            log.error("backup to %s still copying after %.0f s; not waiting longer",
                      self.cfg.backup, self.cfg.backup_wait)  # fmt: skip

    def stats(self) -> dict:
        """For the run summary: the save thread's time by part, and the backup counters."""
        out = {f"checkpoint_{k}_seconds": round(v, 4) for k, v in self.times.items()}
        out["checkpoint_checksum"] = self.algorithm
        out["resumed_tier"] = self.resumed_tier
        if self.backup is not None:
            b = self.backup.status()
            out["backup"] = {k: b[k] for k in ("copies_ok", "copies_failed", "copies_skipped",
                                               "newest_backed_up", "last_error", "copy_seconds")}  # fmt: skip
        return out

    # -- resume -------------------------------------------------------------------
    def resume(self, model, optim, newer_than: int | None = None) -> dict | None:
        """Load the newest validated checkpoint on every rank; returns its trainer state.
        None also when it is not newer than `newer_than` (a tier-0 snapshot's step)."""
        info = self.info
        choice: list = [None]
        if info.rank == 0:
            # with a key, a manifest without a valid HMAC is refused here, before dcp.load
            # unpickles the .metadata it lists
            tiers = [(store.TIER_DISK, self.root), (store.TIER_BACKUP, self.cfg.backup)]
            found, quarantined = store.select_resume_tiers(tiers, key=self.cfg.key)
            for q in quarantined:
                log.warning("quarantined checkpoint %s: %s", q.path, q.reason)
            if found is not None:
                tier, chosen = found
                choice[0] = (chosen.step, str(chosen.path), chosen.world_size, tier)
                if tier == store.TIER_DISK:
                    self._verified.add(store.identity(chosen.path))
                log.info("resuming from step %d in the %s tier (%s)", chosen.step, tier,
                         chosen.path)  # fmt: skip
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        step, path, saved_world, self.resumed_tier = choice[0]
        if newer_than is not None and step <= newer_than:
            self.newest_validated = step  # still the newest on disk
            return None
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        same_world = saved_world == info.world_size
        state_file = Path(path) / _trainer_state_name(info.rank if same_world else 0)
        trainer_state = torch.load(state_file, map_location="cpu", weights_only=True)
        trainer_state["same_world"] = same_world
        self.newest_validated = step
        return trainer_state

"""Asynchronous, validated checkpoints with torch.distributed.checkpoint (DCP).

Save (every `--ckpt-every` steps, at most one in flight):
  main thread   wait for the previous save; write this rank's small trainer-state file
                into `step-N.partial/`; hand model + optimizer state to `dcp.async_save`.
  staging       a background copy of the tensors (device -> host); the trainer waits for
                it only just before the next optimizer step changes the weights
                (`wait_staged`). Training blocks only for these two waits.
  DCP thread    writes and fsyncs this rank's shard files (and rank 0 the metadata).
  our thread    fsync + SHA-256 of this rank's own files; all ranks exchange the entries
                over a dedicated gloo group; rank 0 commits (manifest written and synced,
                then the atomic rename `step-N.partial` -> `step-N`) and applies retention;
                every rank then learns the newest validated step.
So a checkpoint is visible as committed only after every rank's data is durable.

Resume (at every start, every torchrun restart): rank 0 picks the newest validated
checkpoint, quarantining anything incomplete or corrupt on the way, and broadcasts the
choice so all ranks load the same one. DCP reshards on load, so a different world size
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankguard-ckpt")
        self._inflight: Future | None = None
        self._staging: Future | None = None
        self._stager = self._new_stager() if STAGER_REUSABLE else None
        self.newest_validated: int | None = None  # as known to this rank
        self.failures = 0
        self._verified: set[tuple[int, int]] = set()  # identities of checkpoints hashed here

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
                dcp.save(state, storage_writer=writer, process_group=self.info.ckpt_group)
                self._finish(step, partial, _done())
                return time.perf_counter() - start
            response = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.info.ckpt_group,
                async_stager=self._stager or self._new_stager(),  # a new one: torch closes it
            )
        except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
            self._finish(step, partial, _done(exc))  # reported to rank 0 like a failed write
            return time.perf_counter() - start
        self._staging = response.staging_completion
        self._inflight = self._executor.submit(
            self._finish, step, partial, response.upload_completion
        )
        return time.perf_counter() - start

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
            entries = []
            for path in _own_files(partial, info.rank):
                entries.append(store.hash_file(path, fsync=True).to_dict())  # durable, then hashed
            mine = ("ok", entries)
        except (Exception, CheckpointException) as exc:  # reported to rank 0: no commit
            mine = ("error", f"rank {info.rank}: {exc!r}")
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, mine, group=info.ckpt_group)
        outcome: list = [None]
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
                    outcome[0] = ("ok", step)
                except Exception as exc:  # e.g. ENOSPC: stays .partial, never validated
                    outcome[0] = ("error", f"commit failed: {exc!r}")
        dist.broadcast_object_list(outcome, src=0, group=info.ckpt_group)
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

    # -- resume -------------------------------------------------------------------
    def resume(self, model, optim, newer_than: int | None = None) -> dict | None:
        """Load the newest validated checkpoint on every rank; returns its trainer state.
        None also when it is not newer than `newer_than` (a tier-0 snapshot's step)."""
        info = self.info
        choice: list = [None]
        if info.rank == 0:
            # with a key, a manifest without a valid HMAC is refused here, before dcp.load
            # unpickles the .metadata it lists
            chosen, quarantined = store.select_resume(self.root, key=self.cfg.key)
            for q in quarantined:
                log.warning("quarantined checkpoint %s: %s", q.path.name, q.reason)
            if chosen is not None:
                choice[0] = (chosen.step, str(chosen.path), chosen.world_size)
                self._verified.add(store.identity(chosen.path))
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        step, path, saved_world = choice[0]
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

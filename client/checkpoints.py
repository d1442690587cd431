"""`CheckpointStore`: the bundled trainer's validated checkpoints for any script's own state.

    store = CheckpointStore("/ckpt/myjob", keep=3, reporter=rg)
    start, state = store.resume()          # every rank: newest validated, or (0, None)
    if state is not None:                  # (rank 0 selects and quarantines, all load it)
        model.load_state_dict(state["model"])
    ...
    if dist.get_rank() == 0:               # one writer: replicated (DDP) state
        store.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict()})

A save writes ``ROOT/step-N.partial/state.pt`` (``torch.save`` when torch is imported,
else ``pickle``), fsyncs and hashes it, writes ``manifest.json`` and renames the dir to
``ROOT/step-N``: only then is it *validated* (the layout, manifest and checks of
:mod:`rankguard.client.checkpoint_store`, the same ones ``rankguard checkpoints``
reads). ``latest()`` verifies committed checkpoints newest first with their checksums
and moves anything incomplete or corrupt to ``ROOT/quarantine/`` with the reason (never
deletes it); ``keep`` retains the newest K validated ones and never the newest.

A checkpoint key (``key_file=``, else the file named by ``$RANKGUARD_CHECKPOINT_KEY_FILE``)
makes every manifest carry an HMAC: a checkpoint whose manifest is unsigned or tampered
with is corrupt, and :meth:`load` verifies the HMAC and every checksum before it
unpickles anything. Without a key the SHA-256 sums catch corruption, not tampering.
Either way :meth:`load` and :meth:`resume` read data only unless given
``weights_only=False`` (as ``torch.load`` since torch 2.6; the ``pickle`` format too), so
a planted checkpoint cannot run code in the loading process.

One process writes and selects (rank 0 for replicated state); any rank may
:meth:`load` the path it is given. Saving is synchronous (the caller decides when; the
reporter's heartbeats keep a slow save from looking like a hang). Like the rest of
:mod:`rankguard.client`, :meth:`save` never raises into training: a failed save returns
None, is logged and counted in :attr:`failures` (the ``.partial`` dir stays, and the
next ``latest()`` quarantines it). :meth:`load` does raise (``CheckpointError``), since a
resume that silently loads nothing would be worse.

Backup tier: ``CheckpointStore(root, backup="/nfs/ckpt/myjob", backup_keep=3)`` copies
every validated checkpoint there in a low-priority background thread, verifies the copy
against the manifest before committing it, and keeps ``backup_keep`` of them. A full or
failing backup target never fails a save: it is counted (:meth:`backup_status`, also
written to ``ROOT/backup-status.json`` for ``rankguard checkpoints``). :meth:`latest` and
:meth:`resume` pick the newest validated state across both tiers, disk first, so a lost
or corrupt disk tier resumes from the backup. :meth:`close` waits for the last copy.

Bad numerics are never validated (the supervisor's NaN remedy is "resume from the newest
validated checkpoint", so that one must predate the NaN): :meth:`save` refuses, counted
in :attr:`refused` by reason, once the reporter has seen a non-finite loss in this
process (``"non_finite_loss"``), and a state holding a NaN/Inf float or floating tensor
(``"non_finite_state"``: with DDP a NaN on another rank reaches this rank's weights
through the all-reduce a step before its own loss shows it). ``check_finite=False``
skips the scan of the state (one pass over its tensors).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from . import checkpoint_store as cs
from .checkpoint_store import CheckpointError, CheckpointStatus

__all__ = ["CheckpointError", "CheckpointStatus", "CheckpointStore"]

log = logging.getLogger(__name__)

TORCH_FILE = "state.pt"
PICKLE_FILE = "state.pkl"


class CheckpointStore:
    """Validated checkpoints of a script's own state under ``root``.

    ``keep``: how many validated checkpoints to retain (0: all). ``reporter``: a
    :class:`~rankguard.client.Reporter`; each save then runs in its ``checkpoint_save``
    phase (heartbeats) and reports the step as the newest validated checkpoint.
    ``world_size`` is recorded in the manifest (default: ``$WORLD_SIZE`` or 1).
    ``key_file``: the checkpoint key (default: ``$RANKGUARD_CHECKPOINT_KEY_FILE``, or none);
    a bad key file raises ``CheckpointError`` here, at construction.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: int = 0,
        reporter: Any = None,
        world_size: int | None = None,
        check_finite: bool = True,
        key_file: str | os.PathLike[str] | None = None,
        backup: str | os.PathLike[str] | None = None,
        backup_keep: int = 3,
    ) -> None:
        self.root = Path(root)
        self.key = cs.resolve_key(key_file)
        self.backup_root = Path(backup) if backup is not None else None
        if self.backup_root is not None:
            b, r = self.backup_root.absolute(), self.root.absolute()
            if b == r or r in b.parents or b in r.parents:
                raise CheckpointError(f"backup {backup} must be outside {root} (and not hold it)")
        self._backup: cs.BackupWorker | None = None  # started on the first save
        self._verified: set[tuple[int, int]] = set()  # identities of checkpoints hashed here
        self.check_finite = check_finite
        self.keep = keep
        self.backup_keep = backup_keep
        self.reporter = reporter
        try:
            ws = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
        except (TypeError, ValueError):
            ws = 1
        self.world_size = max(1, ws)
        self.failures = 0
        self.saves = 0
        self.refused: dict[str, int] = {}  # saves refused for bad numerics, by reason
        self.last_error: str | None = None

    def save(self, step: int, state: Any, *, extra: dict | None = None) -> Path | None:
        """Write ``state`` as validated checkpoint ``step``; its dir, or None on failure."""
        phase = (
            self.reporter.phase("checkpoint_save")
            if self.reporter is not None
            else contextlib.nullcontext()
        )
        with phase:
            refusal = self._bad_numerics(state)
            if refusal is not None:
                reason, detail = refusal
                self.refused[reason] = self.refused.get(reason, 0) + 1
                self.last_error = f"step {step} not saved: {detail}"
                with contextlib.suppress(Exception):
                    log.error("checkpoint %s", self.last_error)
                return None
            try:
                final = self._save(step, state, extra)
            except Exception as exc:  # nothing may reach the training loop
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(Exception):
                    log.error("checkpoint step %s not saved: %s", step, self.last_error)
                return None
        self.saves += 1
        if self.reporter is not None:
            self.reporter.checkpoint_saved(step)
        return final

    def _bad_numerics(self, state: Any) -> tuple[str, str] | None:
        """Why ``state`` must not become a validated checkpoint, or None."""
        try:
            if self.reporter is not None:
                self.reporter.flush()  # a GPU loss is read a step late: read it now
                bad_step = getattr(self.reporter, "nonfinite_loss_step", None)
                if bad_step is not None:
                    return "non_finite_loss", f"non-finite loss reported at step {bad_step}"
            if self.check_finite:
                where = _first_non_finite(state, "state")
                if where is not None:
                    return "non_finite_state", f"non-finite values in {where}"
        except Exception as exc:  # a failed check must not let bad numerics through
            return "non_finite_state", f"the finiteness check failed: {exc!r}"
        return None

    def _save(self, step: int, state: Any, extra: dict | None) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        partial = cs.partial_dir(self.root, step)
        torch = sys.modules.get("torch")
        if torch is not None:
            path = partial / TORCH_FILE
            torch.save(state, path)
        else:
            path = partial / PICKLE_FILE
            with open(path, "wb") as f:
                pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        entry = cs.hash_file(path, base=partial, algorithm=cs.checksum_for(self.key))  # fsyncs
        final = cs.commit(partial, step, self.world_size, [entry], extra or {}, key=self.key)
        self._verified.add(cs.identity(final))  # hashed just now: retention need not reread it
        if self.backup_root is not None:
            if self._backup is None:
                self._backup = cs.BackupWorker(
                    self.backup_root,
                    keep=self.backup_keep,
                    key=self.key,
                    status_path=self.root / cs.BACKUP_STATUS_NAME,
                )
            self._backup.submit(final)  # never blocks
        if self.keep > 0:
            try:
                cs.apply_retention(self.root, self.keep, key=self.key, verified=self._verified)
            except Exception as exc:  # the save itself is committed
                log.warning("checkpoint retention under %s: %s", self.root, exc)
        return final

    def latest(self) -> CheckpointStatus | None:
        """The newest validated checkpoint (``.step``, ``.path``), verified with its
        checksums; every incomplete or corrupt one met first is quarantined. None when
        there is none (or the root cannot be read: counted in :attr:`failures`)."""
        try:
            tiers = [(cs.TIER_DISK, self.root), (cs.TIER_BACKUP, self.backup_root)]
            chosen, moved = cs.select_resume_tiers(tiers, key=self.key)
            found = chosen[1] if chosen is not None else None
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("no checkpoint selected under %s: %s", self.root, self.last_error)
            return None
        for st in moved:
            log.warning("quarantined %s (%s): %s", st.path, st.original_state, st.reason)
        if found is not None:
            with contextlib.suppress(OSError):
                self._verified.add(cs.identity(found.path))
            if self.reporter is not None:
                self.reporter.checkpoint_saved(found.step)
        return found

    def resume(self, **torch_load: Any) -> tuple[int, Any]:
        """``(step, state)`` of the newest validated checkpoint, or ``(0, None)``: what a
        (re)started script resumes from. With a process group this is a collective (every
        rank calls it): rank 0 selects (:meth:`latest`, which quarantines what is bad) and
        broadcasts the step, and every rank loads that same step. ``torch_load`` as in
        :meth:`load`, which raises ``CheckpointError`` if the chosen one cannot be read."""
        dist = _process_group()
        step = path = None
        if dist is None or dist.get_rank() == 0:
            found = self.latest()
            if found is not None:
                step, path = found.step, str(found.path)  # on disk or in the backup tier
        if dist is not None:
            chosen = [(step, path)]
            dist.broadcast_object_list(chosen, src=0)
            step, path = chosen[0]
        if step is None:
            return 0, None
        if self.reporter is not None:
            self.reporter.checkpoint_saved(step)
        return step, self.load(path, **torch_load)

    def backup_status(self) -> dict[str, Any] | None:
        """The backup tier's counters (copies ok/failed, last error, newest step backed
        up), or None without a backup tier or before the first save."""
        return self._backup.status() if self._backup is not None else None

    def close(self, timeout: float | None = 300.0) -> bool:
        """Wait (up to ``timeout`` s) for the backup copy in flight; False if it is still
        running (a hung target). Without a backup tier there is nothing to wait for."""
        if self._backup is None:
            return True
        return self._backup.close(timeout)

    def load(
        self,
        which: CheckpointStatus | str | os.PathLike[str] | int | None = None,
        *,
        weights_only: bool = True,
        **torch_load: Any,
    ) -> Any:
        """The state saved in ``which``: a status from :meth:`latest`, a step dir, a step
        number, or None for :meth:`latest`. Checks the dir's manifest (sizes) first; with a
        key, its HMAC and every checksum, before anything is unpickled.

        ``weights_only`` means what it means to ``torch.load``, and defaults to True as
        there (torch >= 2.6), for both formats: data only (tensors, containers, numbers,
        strings); a file naming any other class or function is refused with
        ``CheckpointError`` before it is called. ``weights_only=False`` runs whatever the
        file's pickle names: only for a checkpoint whose writer you trust (an unkeyed root
        trusts everyone who can write into it). ``torch_load`` goes to ``torch.load``
        (e.g. ``map_location``). Raises ``CheckpointError`` when there is nothing valid to
        load."""
        if which is None:
            which = self.latest()
            if which is None:
                raise CheckpointError(f"no validated checkpoint under {self.root}")
        if isinstance(which, CheckpointStatus):
            path = Path(which.path)
        elif isinstance(which, int) and not isinstance(which, bool):
            path = self.root / cs.step_dir_name(which)
        else:
            path = Path(which)
        status = cs.inspect(path, verify_checksums=self.key is not None, key=self.key)
        if status.state != cs.VALIDATED:
            raise CheckpointError(f"{path} is {status.state}: {status.reason}")
        file = path / TORCH_FILE
        try:
            if file.exists():
                import torch

                return torch.load(file, weights_only=weights_only, **torch_load)
            file = path / PICKLE_FILE
            with open(file, "rb") as f:
                return (cs.DataUnpickler(f) if weights_only else pickle.Unpickler(f)).load()
        except pickle.UnpicklingError as exc:  # a global weights_only refused, or no pickle
            raise CheckpointError(f"{file} refused: {exc}") from None


def _process_group() -> Any:
    """``torch.distributed`` when a process group is initialized (torch imported), else
    None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _first_non_finite(value: Any, where: str) -> str | None:
    """The path of the first NaN/Inf float or floating tensor in nested dicts, lists and
    tuples (``state['model']['0.weight']``), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_non_finite(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_non_finite(item, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and (value.is_floating_point() or value.is_complex())
    ):
        local = value.to_local() if hasattr(value, "to_local") else value  # DTensor: the shard
        if not bool(torch.isfinite(local).all()):
            return where
    return None

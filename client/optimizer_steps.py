"""A zero-code worker's optimizer step, so that its incidents can name the step a rank
died or hung at without a line of the script changed.

The bootstrap (client/bootstrap/sitecustomize.py) registers :func:`hook` as torch's global
optimizer post-step hook when the script imports ``torch.optim.optimizer``: in the
importing thread, before any step (added later from another thread, it could race the
step's own iteration over the hooks). The collective watch (client/collective_watch.py)
reads :func:`step` and sends it to the agent as a beacon.

The step is absolute only where the optimizer keeps one in its state, as Adam, AdamW and
their kin do (``state[p]["step"]``, saved with it and loaded on a resume): read once, at
the first step seen, then counted. Elsewhere (SGD, or a step held on the GPU, where
reading it would wait for the device) it is unknown, never a count since the process
started posing as the script's step. Only the first optimizer that steps is followed.

Nothing here writes to the optimizer (``state.get``, never ``state[p]``, which would add an
entry to its state dict) or raises into the step.
"""

from __future__ import annotations

from typing import Any

_followed: int | None = None  # id() of the optimizer followed
_base: int | None = None  # its step at the first step seen (None: it keeps none)
_since = 0  # steps it took after that one


def hook(optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
    """torch's post-step hook: called after every optimizer's step, in the step's thread."""
    global _followed, _base, _since
    try:
        if _followed is None:
            _followed, _base = id(optimizer), persisted_step(optimizer)
        elif id(optimizer) == _followed:
            _since += 1
    except Exception:  # never the script's problem
        return


def persisted_step(optimizer: Any) -> int | None:
    """The step an optimizer keeps in its state (after this step), when it keeps one on
    the CPU; None otherwise."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or "step" not in state:
                continue
            value = state["step"]
            device = getattr(value, "device", None)
            if device is not None and device.type != "cpu":
                return None  # reading it would synchronise with the device
            return int(value)
    return None


def step() -> int | None:
    """The followed optimizer's step, when known."""
    return None if _base is None else _base + _since


def reset() -> None:
    """Forget the optimizer followed (tests)."""
    global _followed, _base, _since
    _followed, _base, _since = None, None, 0

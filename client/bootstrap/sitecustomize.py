"""rankguard's bootstrap, run by Python at the start of every process that has this
folder on its ``PYTHONPATH`` (`rankguard up` and the Slurm script put it there for the
torchrun workers). In a torchrun worker (``RANK``, ``LOCAL_RANK`` and
``TORCHELASTIC_RUN_ID`` set; ``RANKGUARD_COLLECTIVE_WATCH=0`` turns it off) it starts one
daemon thread that waits, with the standard library alone, for the script's process group,
then runs the collective watch (``rankguard.client.collective_watch``): nothing is
imported at start-up and nothing runs in the script's thread. Then it runs the
``sitecustomize`` this one shadows (the user's, a distribution's), as Python would have.
With ``$RANKGUARD_STARTUP_GUARD`` set it also records, at the worker's own exit,
whether its process group ever formed (``rankguard.contract.startup_guard``): a worker that
fails before it did is a start-up error, ended rather than restarted.
Nothing here may fail the script: every error is swallowed."""

import contextlib
import os
import sys
import threading
import time

_STARTED = time.monotonic()
_HAD_GROUP = []  # set once the worker's process group was seen formed


def _group_ready():
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def _watch(environ):
    while not _group_ready():
        time.sleep(0.5)
    _HAD_GROUP.append(True)
    try:
        from rankguard.client import collective_watch

        collective_watch.run(environ)
    except Exception:
        pass


def _start():
    env = os.environ
    worker = all(env.get(n) for n in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"))
    if worker and env.get("RANKGUARD_COLLECTIVE_WATCH") != "0":
        args = (dict(env),)
        threading.Thread(
            target=_watch, args=args, name="rankguard-collectives", daemon=True
        ).start()
        sys.meta_path.insert(0, _OptimizerImport())


class _OptimizerImport:
    """A meta path finder for one module, torch.optim.optimizer: once the script's import
    of it has run, torch's global optimizer post-step hook counts the script's steps
    (rankguard.client.optimizer_steps), registered in the importing thread, before any
    step. Every other import, and this one, is left to the finders after it."""

    NAME = "torch.optim.optimizer"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        try:
            return self._counted(name, path, target)
        except Exception:  # the import goes on without the count: never the script's problem
            return None

    def _counted(self, name, path, target):
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module):
                run(module)
                with contextlib.suppress(Exception):
                    from rankguard.client import optimizer_steps

                    module.register_optimizer_step_post_hook(optimizer_steps.hook)

            loader.exec_module = exec_module
        return spec


def _at_exit(path, environ):
    with contextlib.suppress(Exception):
        from rankguard.contract import startup_guard

        had_group = bool(_HAD_GROUP) or _group_ready()
        startup_guard.record_exit(path, environ, had_group, _STARTED)


def _guard():
    env = os.environ
    path = env.get("RANKGUARD_STARTUP_GUARD")
    if path and all(env.get(n) for n in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")):
        import atexit

        atexit.register(_at_exit, path, dict(env))


def _chain():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


with contextlib.suppress(Exception):
    _start()
with contextlib.suppress(Exception):
    _guard()
with contextlib.suppress(Exception):
    _chain()

"""Goodput under one fault schedule: rankguard against plain torchrun and NVIDIA's
resiliency extension, the same DDP job (bench/goodput_train.py) under each, in turn.

    python bench/goodput.py [--quick] [--stacks plain,nvrx,rankguard,rankguard-best]
                            [--spacing SECONDS] [--out bench/results/goodput.md] [--json FILE]

Per stack: a fault-free calibration run (its step time), then the job under the schedule of
bench/goodput_schedule.toml, faults injected from here at wall-clock times: signals to the
worker found in the launcher's process tree (by its RANK), checkpoint corruption on disk,
and in-process faults through the script's trigger files (same for every stack).

--spacing S places the schedule's faults S seconds apart (same kinds, same order) and
sizes each stack's job to span them: steps = (first fault + faults x S) / the stack's
calibrated step time, so the last fault gets a full window too. Without it, the full
schedule's job is sized the same way from its own fault times (`fit_steps`): every stack
meets every fault, however fast its steps. --calibration-steps N
lengthens the calibration run (the schedule's 100 steps take 5 s, and the step time they
measure moves by several percent between runs on a shared machine).

Goodput = useful / wall: useful = the steps in the final model's history (steps redone after
a rollback do not count, nor steps trained on a NaN model) x the calibrated step time; wall =
launch to exit. docs/goodput.md says how every figure is counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from rankguard.cli.local_stack import SnapshotHolders

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "goodput_train.py"
STACKS = ("plain", "nvrx", "rankguard", "rankguard-best")
RESTART_KINDS = ("kill", "stop", "spin", "corrupt_kill")  # no stack can ride these out
SIGNAL_KINDS = ("kill", "stop", "corrupt_kill")
FILE_KIND = {"spin": "hang", "slow": "slow", "nan": "nan", "stall": "stall"}
MAX_RESTARTS = 20
SNAPSHOT_EVERY = 10  # rankguard-best: a tier-0 snapshot every this many steps
# nvidia-resiliency-ext: its documented heartbeat settings, tuned to this job (see --help)
NVRX_ARGS = ["--ft-initial-rank-heartbeat-timeout=60", "--ft-rank-heartbeat-timeout=5",
             "--ft-workload-check-interval=1", "--ft-restart-policy=any-failed"]  # fmt: skip


def fail(msg: str) -> None:
    print(f"goodput: {msg}", file=sys.stderr)
    raise SystemExit(2)


# -- schedule (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    rank: int
    at: float  # seconds after the first step


def load_schedule(
    path: Path, quick: bool, spacing: float | None = None
) -> tuple[dict, list[Fault]]:
    try:
        doc = tomllib.loads(path.read_text())
        params = dict(doc["quick" if quick else "full"])
        kinds, seed, rank = list(doc["kinds"]), int(doc["seed"]), int(doc["rank"])
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        fail(f"{path}: {exc}")
    unknown = [k for k in kinds if k not in (*SIGNAL_KINDS, *FILE_KIND)]
    if unknown:
        fail(f"{path}: unknown fault kinds {unknown}")
    faults = expand_schedule(kinds, seed, rank, params)
    if spacing is not None:
        faults = spaced(faults, float(params["first_at_seconds"]), spacing)
        span = schedule_span(params, len(faults), spacing)
        # a fault waits until the job trains again after the previous one: room for that
        params["run_limit_seconds"] = max(params["run_limit_seconds"], 1.5 * span + 300)
    return params, faults


def expand_schedule(kinds: list[str], seed: int, rank: int, params: dict) -> list[Fault]:
    """The seed's order (NaN last) and gaps (0.75-1.25 x the mean)."""
    rng = random.Random(seed)
    order = [k for k in kinds if k != "nan"]
    rng.shuffle(order)
    order += [k for k in kinds if k == "nan"]
    out, at = [], float(params["first_at_seconds"])
    for i, kind in enumerate(order):
        out.append(Fault(i + 1, kind, 0 if kind == "stall" else rank, round(at, 1)))
        at += params["mean_gap_seconds"] * rng.uniform(0.75, 1.25)
    return out


def spaced(faults: list[Fault], first_at: float, spacing: float) -> list[Fault]:
    """The same faults in the same order, exactly `spacing` seconds apart."""
    return [Fault(f.id, f.kind, f.rank, round(first_at + i * spacing, 1)) for i, f in enumerate(faults)]  # fmt: skip


def schedule_span(params: dict, n_faults: int, spacing: float) -> float:
    """Fault-free seconds of training the job needs so the schedule fits in it: the first
    fault's time plus one spacing for every fault (the last one gets a full window)."""
    return float(params["first_at_seconds"]) + n_faults * spacing


def steps_for(params: dict, faults: list[Fault], spacing: float | None, t_step: float) -> int:
    """The faulted run's steps: the schedule file's, or, with a spacing or where the
    schedule asks for it (`fit_steps`), at least enough fault-free training at the stack's
    calibrated step time for the last fault to fall inside the job with a full gap after
    it. Fitted, every stack meets every fault: at a fixed 1600 steps, today's 32 ms steps
    ended the stacks that lose the least before the last two faults (a hang among them)."""
    fit = spacing is not None or bool(params.get("fit_steps", False))
    if not fit or not faults or not math.isfinite(t_step) or t_step <= 0:
        return int(params["steps"])
    gap = spacing if spacing is not None else float(params["mean_gap_seconds"])
    return max(int(params["steps"]), math.ceil((faults[-1].at + gap) / t_step))


# -- process tree ----------------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


WARM_SHIM = b"rankguard.trainer.warm\0run\0"
WARM_SERVER = b"rankguard.trainer.warm\0serve\0"


def _rank_of(pid: int) -> int | None:
    """A training worker's RANK (from its environment), None for anything else. Under
    warm start (trainer/warm.py) torchrun's child is a shim and the worker is forked by
    the warm server (its cmdline and environment are the server's): the worker is the
    server's child that holds a pidfd on a shim, and its RANK is the shim's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if WARM_SERVER in cmdline:
            shim = _pidfd_target(pid)
            return _shim_rank(shim) if shim is not None else None
        if SCRIPT.name.encode() not in cmdline or WARM_SHIM in cmdline:
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    return _rank_in(env)


def _rank_in(env: list[bytes]) -> int | None:
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _pidfd_target(pid: int) -> int | None:
    """The process a pidfd of `pid` refers to (fdinfo's `Pid:`), if it holds one."""
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return None
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        for line in info.splitlines():
            if line.startswith("Pid:") and line[4:].strip().lstrip("-").isdigit():
                return int(line[4:])
    return None


def _shim_rank(pid: int) -> int | None:
    """RANK of a warm-start shim of this benchmark's script."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if WARM_SHIM not in cmdline or SCRIPT.name.encode() not in cmdline:
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            return _rank_in(f.read().split(b"\0"))
    except OSError:
        return None


def workers(root: int) -> dict[int, int]:
    """rank -> pid of the training workers under the launcher `root`."""
    kids, out, todo = _children_map(), {}, [root]
    while todo:
        pid = todo.pop()
        for child in kids.get(pid, []):
            todo.append(child)
            rank = _rank_of(child)
            if rank is not None and rank not in out:
                out[rank] = child
    return out


def corrupt_newest(ckpt: Path) -> str:
    """Flip bytes in the newest committed checkpoint's state file (same size: only its
    checksum can tell)."""
    steps = sorted((int(p.name[5:]), p) for p in ckpt.glob("step-*") if p.name[5:].isdigit())
    if not steps:
        return "no committed checkpoint to corrupt"
    step, path = steps[-1]
    for f in path.iterdir():
        if f.name.startswith("state."):
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                chunk = fh.read(64)
                fh.seek(f.stat().st_size // 2)
                fh.write(bytes(b ^ 0xFF for b in chunk))
            return f"corrupted step {step}"
    return f"step {step} has no state file"


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Injected:
    fault: Fault
    t: float  # when it took effect (signal sent; trigger claimed by the rank)
    pids: dict[int, int]  # the workers at that moment
    note: str = ""
    stuck_s: float | None = None  # no step for give_up_seconds: the benchmark gave up


@dataclass
class Run:
    stack: str
    launched: float
    ended: float = 0.0
    code: int | None = None
    finished: bool = False
    events: list[dict] = field(default_factory=list)  # rank 0's progress lines
    gone: dict[int, float] = field(default_factory=dict)  # worker pid -> when it was gone
    workers: set[int] = field(default_factory=set)  # every worker pid seen
    injected: list[Injected] = field(default_factory=list)
    not_injected: list[Fault] = field(default_factory=list)
    note: str = ""


def stack_cmd(stack: str, d: Path, steps: int, ckpt_every: int) -> tuple[list[str], dict]:
    py = sys.executable
    script = [str(SCRIPT), "--steps", str(steps), "--ckpt-dir", str(d / "ckpt"),
              "--ckpt-every", str(ckpt_every), "--progress", str(d / "progress.jsonl"),
              "--faults", str(d / "faults")]  # fmt: skip
    # every stack: a fresh rendezvous store per restart (cli/up.py sets it for scripts; a
    # restarted group could otherwise read the dead one's gloo addresses and hang)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("RANKGUARD_TELEMETRY_SOCKET", None)
    rdzv = ["--standalone", "--nproc-per-node=2", f"--max-restarts={MAX_RESTARTS}"]
    if stack == "plain":
        return [py, "-m", "torch.distributed.run", *rdzv, *script], env
    if stack == "nvrx":
        launcher = shutil.which("ft_launcher", path=str(Path(py).parent))
        return [launcher, *rdzv, *NVRX_ARGS, *script], env
    up = [py, "-m", "rankguard.cli.main", "up", "--nproc", "2", f"--max-restarts={MAX_RESTARTS}",
          "--run-dir", str(d / "up"), "--ckpt-dir", str(d / "ckpt")]  # fmt: skip
    if stack == "rankguard-best":  # warm workers (trainer/warm.py); tier-0 snapshots: holders()
        up.append("--warm-start")
    return [*up, "--", *script], env


@contextlib.contextmanager
def holders(stack: str, d: Path):
    """rankguard-best's tier-0 snapshot holders, A (the node's) replicating to B: yields
    the training script's flags for them (none for the other stacks)."""
    if stack != "rankguard-best":
        yield []
        return
    try:
        started = SnapshotHolders(d, SNAPSHOT_EVERY)
    except RuntimeError as exc:
        fail(str(exc))
    with started:
        yield started.args


class Progress:
    """Follows the progress file as it grows."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, ""

    def read(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        self.buf += data
        *lines, self.buf = self.buf.split("\n")
        return [json.loads(line) for line in lines if line.strip()]


def run_stack(stack: str, d: Path, params: dict, schedule: list[Fault], steps: int) -> Run:
    """One run of the job under `stack`, with `schedule` injected (none: calibration)."""
    d.mkdir(parents=True)
    (d / "faults").mkdir()
    cmd, env = stack_cmd(stack, d, steps, params["ckpt_every"])
    with holders(stack, d) as snapshot_args, open(d / "launcher.log", "w") as log:
        cmd += snapshot_args  # the script's own flags: the script comes last in every stack
        run = Run(stack, time.time())
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            drive(run, proc, d, params, schedule)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # up stops its daemons on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of the job's left behind
            for pid in run.workers:  # torchrun starts each worker in its own session
                if _rank_of(pid) is not None:  # still one of ours (not a reused pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    run.events += Progress(d / "progress.jsonl").read()[len(run.events) :]
    return run


def drive(run: Run, proc: subprocess.Popen, d: Path, params: dict, schedule: list[Fault]) -> None:
    progress = Progress(d / "progress.jsonl")
    todo = list(schedule)
    seen: dict[int, int] = {}  # worker pid -> rank, while alive
    first_step: float | None = None
    pending: tuple[Fault, dict[int, int], float] | None = None  # a trigger not yet claimed
    limit = run.launched + params["run_limit_seconds"]
    while proc.poll() is None:
        now = time.time()
        run.events += progress.read()
        steps = [e for e in run.events if e["event"] == "step"]
        if steps and first_step is None:
            first_step = steps[0]["t"]
        current = workers(proc.pid)
        for pid in list(seen):
            if pid not in current.values():
                run.gone[pid] = now
                del seen[pid]
        seen.update({pid: rank for rank, pid in current.items()})
        run.workers.update(current.values())
        if now > limit:
            run.note = f"stopped by the benchmark after {params['run_limit_seconds']} s"
            break
        last = run.injected[-1] if run.injected else None
        if pending is not None:  # an in-process fault takes effect when the rank claims it
            fault, pids, sent = pending
            taken = d / "faults" / f"{fault.id}.taken"
            if taken.exists():
                with contextlib.suppress(ValueError, OSError):
                    run.injected.append(Injected(fault, json.loads(taken.read_text())["t"], pids))
                    pending = None
            elif now - sent > params["give_up_seconds"]:
                run.injected.append(Injected(fault, sent, pids, "never claimed"))
                pending = None
        elif last is not None and last.stuck_s is None and not settled(last, steps, now, params):
            quiet = now - max([last.t] + [e["t"] for e in steps[-1:]])
            acted = any(p in run.gone for p in last.pids.values())
            if not acted and quiet > params["give_up_seconds"]:
                # the stack never acted: not recovered. The benchmark gives up and kills
                # the workers as an operator would, so the rest of the schedule still runs
                last.stuck_s = now - last.t
                for pid in current.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            elif acted and quiet > max(30.0, 2 * params["give_up_seconds"]):
                run.note = f"stopped by the benchmark: no step for {quiet:.0f} s after a restart"
                break
        elif (
            todo
            and first_step is not None
            and now >= first_step + todo[0].at
            and steps
            and now - steps[-1]["t"] < 1.0  # training, not restarting
            and len(current) == 2
        ):
            pending = inject(todo.pop(0), current, d, run, params)
        time.sleep(0.2)  # /proc walks cost CPU the job shares
    run.ended = time.time()
    run.code = proc.poll()
    run.not_injected = todo + ([pending[0]] if pending else [])
    run.finished = run.code == 0 and any(e["event"] == "done" for e in run.events)


def settled(last: Injected, steps: list[dict], now: float, params: dict) -> bool:
    """The job trains again past where the last fault found it (and a slowdown is over)."""
    if last.fault.kind == "slow" and now < last.t + params["slow_seconds"]:
        return False
    before = [e["step"] for e in steps if e["t"] <= last.t]
    at = max(before) if before else 0
    # a few steps on: the peer of a stopped rank may still finish the step in flight
    return any(e["t"] > last.t and e["step"] >= at + 5 for e in steps[-50:])


def inject(fault: Fault, current: dict[int, int], d: Path, run: Run, params: dict):
    pids = dict(current)
    target = current.get(fault.rank)
    if fault.kind in SIGNAL_KINDS:
        note = corrupt_newest(d / "ckpt") if fault.kind == "corrupt_kill" else ""
        sig = signal.SIGSTOP if fault.kind == "stop" else signal.SIGKILL
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, sig)
        run.injected.append(Injected(fault, time.time(), pids, note))
        return None
    body = {"kind": FILE_KIND[fault.kind], "rank": fault.rank, "factor": 1.5}
    if fault.kind in ("slow", "stall"):
        body["seconds"] = params[f"{fault.kind}_seconds"]
    tmp = d / "faults" / f"{fault.id}.tmp"
    tmp.write_text(json.dumps(body))
    tmp.rename(d / "faults" / f"{fault.id}.json")
    return fault, pids, time.time()


# -- accounting (pure) ------------------------------------------------------------------------


def incarnations(events: list[dict]) -> list[dict]:
    """Rank 0's processes in order: pid, resumed step, steps trained (first, last), times."""
    out: dict[int, dict] = {}
    for e in events:
        inc = out.setdefault(e["pid"], {"pid": e["pid"], "resumed": None, "steps": [],
                                         "start": e["t"], "end": e["t"]})  # fmt: skip
        inc["end"] = e["t"]
        if e["event"] == "resume":
            inc["resumed"] = e["step"]
            inc["source"] = e.get("source")
        elif e["event"] == "step":
            inc["steps"].append(e)
    return sorted(out.values(), key=lambda i: i["start"])


def history(events: list[dict]) -> dict:
    """Executed, kept (in the final model's history) and lost steps, and where a NaN
    poisoned the final history (its steps from there on are not useful)."""
    incs = [i for i in incarnations(events) if i["resumed"] is not None]
    executed = sum(len(i["steps"]) for i in incs)
    if not incs:
        return {"executed": 0, "kept": 0, "lost": 0, "final_step": 0, "useful_steps": 0,
                "poisoned_at": None}  # fmt: skip
    final = incs[-1]
    final_step = max([final["resumed"]] + [e["step"] for e in final["steps"]])
    # walk back along the resumes: which process trained each step of the final model
    chain, need = [], final_step
    for inc in reversed(incs):
        mine = [e for e in inc["steps"] if inc["resumed"] < e["step"] <= need]
        if mine:
            chain = mine + chain
            need = inc["resumed"]
        if need == 0:
            break
    chain.sort(key=lambda e: e["step"])
    kept = len(chain)
    poisoned = next((e["step"] for e in chain if isinstance(e["loss"], str)), None)
    useful = kept if poisoned is None else max(0, poisoned - 2)  # the NaN came a step earlier
    return {"executed": executed, "kept": kept, "lost": executed - kept,
            "final_step": final_step, "useful_steps": useful, "poisoned_at": poisoned}  # fmt: skip


def step_time(events: list[dict]) -> float:
    """Fault-free seconds a step (checkpoints included), the first 5 steps left out."""
    steps = [e for e in events if e["event"] == "step"][5:]
    if len(steps) < 2:
        return math.nan
    return (steps[-1]["t"] - steps[0]["t"]) / (len(steps) - 1)


def quiet_step_time(run: Run, before: float = 5.0, after: float = 30.0) -> float:
    """The faulted run's own fault-free step time: the mean interval between consecutive
    steps of one process, away from every fault (`before` s ahead of it to `after` s past
    it). A calibration run measures the machine of a minute earlier; on a shared machine
    whose step rate drifts by 10% over minutes, this one measures the same minutes."""
    faults = [i.t for i in run.injected]
    steps = sorted((e for e in run.events if e["event"] == "step"), key=lambda e: e["t"])
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False)
            if a["pid"] == b["pid"] and b["step"] == a["step"] + 1
            and not any(-before < a["t"] - t < after for t in faults)]  # fmt: skip
    return sum(gaps) / len(gaps) if gaps else math.nan


def per_fault(run: Run, t_step: float, poisoned_at: int | None) -> list[dict]:
    """Per injected fault: detect (the faulted group gone), recover (first step of a new
    process), lost steps (trained, then rolled back), cost (the window to the next fault
    minus its net useful progress x the step time), and the outcome."""
    incs = [i for i in incarnations(run.events) if i["resumed"] is not None]
    steps = sorted((e for e in run.events if e["event"] == "step"), key=lambda e: e["t"])
    cap = poisoned_at - 2 if poisoned_at else math.inf

    def reached(t: float) -> float:
        """The step the job's model stands at, at time t (rollbacks included)."""
        at = 0
        for inc in incs:
            if inc["start"] > t:
                break
            done = [e["step"] for e in inc["steps"] if e["t"] <= t]
            at = max(done) if done else inc["resumed"] if inc["resumed"] is not None else at
        return min(at, cap)

    out = []
    for n, inj in enumerate(run.injected):
        old = set(inj.pids.values())
        nxt = run.injected[n + 1].t if n + 1 < len(run.injected) else run.ended
        gone = [run.gone.get(p) for p in old]
        ended = any(e["event"] == "done" and e["pid"] in old for e in run.events)
        acted = gone and all(g and g < nxt for g in gone) and not ended  # not just finished
        detect = max(gone) - inj.t if acted else None
        new = next(
            (i for i in incs if i["start"] > inj.t and i["start"] < nxt and i["steps"]), None
        )
        recover = lost = None
        if new is not None and detect is not None:
            recover = new["steps"][0]["t"] - inj.t
            last_old = [e["step"] for e in steps if e["pid"] in old and e["t"] <= inj.t + 60]
            lost = max(0, max(last_old, default=0) - new["resumed"])
        cost = (nxt - inj.t) - (reached(nxt) - reached(inj.t)) * t_step
        if inj.stuck_s is not None:
            outcome = f"not recovered: stuck {inj.stuck_s:.0f} s, gave up"
        elif inj.fault.kind == "nan" and poisoned_at is not None:
            outcome = "not recovered: trained on a NaN model to the end"
        elif detect is not None and new is not None:
            outcome = f"recovered (restart, resumed from {new.get('source')})"
        elif inj.fault.kind in RESTART_KINDS:
            outcome = "not recovered"
        else:
            outcome = "ridden out (no restart)"
        out.append({"id": inj.fault.id, "kind": inj.fault.kind, "rank": inj.fault.rank,
                    "at": inj.t - run.launched, "detect": detect, "recover": recover,
                    "lost": lost, "cost": cost, "outcome": outcome, "note": inj.note})  # fmt: skip
    return out


def summarize(run: Run, cal: Run) -> dict:
    t_step = step_time(cal.events)
    h = history(run.events)
    wall = run.ended - run.launched
    useful = h["useful_steps"] * t_step
    faults = per_fault(run, t_step, h["poisoned_at"])
    cal_wall = cal.ended - cal.launched
    cal_steps = history(cal.events)["useful_steps"]
    startup = cal_wall - cal_steps * t_step  # launch, exit: what a fault-free run pays too
    t_quiet = quiet_step_time(run)
    costs = [f["cost"] for f in faults]
    per = sum(costs) / len(costs) if costs else 0.0
    return {"stack": run.stack, "finished": run.finished, "note": run.note, "wall": wall,
            "t_step": t_step, "useful": useful, "goodput": useful / wall if wall > 0 else 0.0,
            "t_quiet": t_quiet, "goodput_quiet": h["useful_steps"] * t_quiet / wall if wall > 0 else 0.0,
            "cal_goodput": cal_steps * t_step / cal_wall if cal_wall > 0 else 0.0,
            "startup": startup, "cost_per_fault": per, "goodput_at_2min": 120 / (120 + per),
            "faults": faults, "not_injected": [f.kind for f in run.not_injected], **h}  # fmt: skip


# -- report -------------------------------------------------------------------------------------


def f1(v, unit="") -> str:
    return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else str(v)


def steps_text(results: list[dict], params: dict) -> str:
    spacing, fit = params.get("spacing"), params.get("fit_steps")
    if not spacing and not fit:
        return f"{params['steps']} steps"
    each = ", ".join(f"{r['stack']} {r['steps']}" for r in results)
    rule = "first fault + faults x spacing" if spacing else "last fault + one mean gap"
    return (
        "steps sized per stack to span the schedule at its calibrated step time "
        f"({rule}, at least {params['steps']}: {each})"
    )


def spacing_text(params: dict) -> str:
    s = params.get("spacing")
    return f" {s:g} s apart (--spacing; the schedule's kinds and order)" if s else ""


def report(results: list[dict], schedule: list[Fault], params: dict, command: str) -> str:
    base = next((r for r in results if r["stack"] == "plain"), None)
    lines = [f"Command: `{command}`", "",
             f"2 ranks (gloo, CPU), {steps_text(results, params)}, {len(schedule)} faults"
             f"{spacing_text(params)}; "
             "goodput = steps in the final model's history x fault-free step time / wall "
             "(docs/goodput.md).", "",
             "| stack | finished | goodput | vs plain torchrun | wall s | useful s | step ms "
             "| steps run / kept / lost | faults recovered | s lost per fault | "
             "goodput at 1 fault / 2 min (extrapolated) | goodput at the run's own step time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        ratio = f"{r['goodput'] / base['goodput']:.2f}x" if base and base["goodput"] else "-"
        rec = sum(f["outcome"].startswith("recovered") for f in r["faults"])
        need = sum(not f["outcome"].startswith("ridden") for f in r["faults"])
        lines.append(
            f"| {r['stack']} | {'yes' if r['finished'] else 'no'} | {r['goodput']:.1%} | {ratio} "
            f"| {r['wall']:.0f} | {r['useful']:.0f} | {r['t_step'] * 1000:.0f} "
            f"| {r['executed']} / {r['kept']} / {r['lost']} | {rec} of {need} needing one "
            f"| {r['cost_per_fault']:.1f} | {r['goodput_at_2min']:.1%} "
            f"| {r['goodput_quiet']:.1%} ({r['t_quiet'] * 1000:.1f} ms) |"
        )
    lines += ["", "Per fault kind (detect: fault -> the faulted group is gone; recover: fault "
              "-> first step of the new processes; cost: seconds of the fault's window not "
              "spent on useful steps):", "",
              "| fault | " + " | ".join(r["stack"] for r in results) + " |",
              "|---|" + "---|" * len(results)]  # fmt: skip
    for fault in schedule:
        cells = []
        for r in results:
            f = next((x for x in r["faults"] if x["id"] == fault.id), None)
            if f is None:
                cells.append("not injected")
                continue
            cells.append(f"detect {f1(f['detect'])} s, recover {f1(f['recover'])} s, lost "
                         f"{f1(f['lost'])}, cost {f1(f['cost'])} s: {f['outcome']}")  # fmt: skip
        lines.append(f"| {fault.kind} | " + " | ".join(cells) + " |")
    lines += ["", "Raw timeline (seconds after launch):", ""]
    for r in results:
        extra = f"; {r['note']}" if r["note"] else ""
        lines.append(f"- **{r['stack']}** (calibration: {r['t_step'] * 1000:.1f} ms a step, "
                     f"fault-free goodput {r['cal_goodput']:.1%}, startup and exit "
                     f"{r['startup']:.1f} s{extra})")  # fmt: skip
        for f in r["faults"]:
            lines.append(f"  - {f['at']:7.1f} {f['kind']} (rank {f['rank']}{', ' + f['note'] if f['note'] else ''}): "
                         f"detect {f1(f['detect'])}, recover {f1(f['recover'])}, lost steps "
                         f"{f1(f['lost'])}, cost {f1(f['cost'])} s; {f['outcome']}")  # fmt: skip
        for kind in r["not_injected"]:
            lines.append(f"  - {kind}: not injected (the run ended first)")
        owned = sum(f["lost"] or 0 for f in r["faults"])
        lines.append(f"  - {r['wall']:7.1f} exit ({'finished' if r['finished'] else 'not finished'}"
                     f", final step {r['final_step']}; steps run {r['executed']}, kept "
                     f"{r['kept']}, lost {r['lost']}, of which no fault's restart: "
                     f"{r['lost'] - owned})")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the short schedule (for the tests)")
    p.add_argument(
        "--stacks", default=",".join(STACKS), help=f"comma-separated: {', '.join(STACKS)}"
    )
    p.add_argument("--schedule", type=Path, default=HERE / "goodput_schedule.toml")
    p.add_argument("--out", type=Path, help="the results (markdown)")
    p.add_argument("--json", type=Path, help="every figure, for tests")
    p.add_argument("--keep-dir", type=Path, help="keep every run's files here")
    p.add_argument(
        "--spacing",
        type=float,
        help="seconds between faults (same kinds and "
        "order; each stack's job sized to span them: see the docstring)",
    )
    p.add_argument(
        "--calibration-steps",
        type=int,
        help="steps of the fault-free run that measures each stack's step time (default: "
        "the schedule's); the goodput is only as steady as this: at 100 steps (5 s) on a "
        "shared machine, +-4%% between runs",
    )
    args = p.parse_args()
    stacks = [s for s in args.stacks.split(",") if s]
    bad = [s for s in stacks if s not in STACKS]
    if bad or not stacks:
        fail(f"--stacks: unknown {bad or 'empty'}; expected some of {', '.join(STACKS)}")
    if args.spacing is not None and not (math.isfinite(args.spacing) and args.spacing > 0):
        fail(f"--spacing {args.spacing}: expected seconds > 0")
    params, schedule = load_schedule(args.schedule, args.quick, args.spacing)
    if args.calibration_steps is not None:
        if args.calibration_steps < 20:
            fail(f"--calibration-steps {args.calibration_steps}: expected at least 20")
        params["calibration_steps"] = args.calibration_steps
    if "nvrx" in stacks and not shutil.which("ft_launcher", path=str(Path(sys.executable).parent)):
        fail("nvrx: ft_launcher not found (pip install nvidia-resiliency-ext)")
    command = "python bench/goodput.py " + " ".join(sys.argv[1:])
    results = []
    params["spacing"] = args.spacing
    root = args.keep_dir or Path(tempfile.mkdtemp(prefix="rg-goodput-"))
    try:
        for stack in stacks:
            print(f"goodput: {stack}: calibration ...", file=sys.stderr, flush=True)
            cal = run_stack(stack, root / f"{stack}-cal", params, [], params["calibration_steps"])
            print(f"goodput: {stack}: faulted run ...", file=sys.stderr, flush=True)
            steps = steps_for(params, schedule, args.spacing, step_time(cal.events))
            run = run_stack(stack, root / stack, params, schedule, steps)
            results.append({**summarize(run, cal), "steps": steps})
    finally:
        if args.keep_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text = report(results, schedule, params, command)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"schedule": [f.__dict__ for f in schedule],
                                         "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

"""Many simulated rankguard agents in one process, for the supervisor's scale benchmark.

Serves, on one loopback port, `/agents/<i>/v1/node`, `/agents/<i>/v1/ranks` and the
control endpoints for every simulated node i, so the supervisor's agents file holds one
URL per node (`http://127.0.0.1:PORT/agents/<i>`) and addresses each as it would a real
agent: AgentClient appends `/v1/...` to the URL.

The JSON is the real agent's: every answer is built from the contract's models
(contract/answers.py `NodeAnswer`, `RanksAnswer`, `RankAnswer`, `Sample`) in the httpd's
compact layout, so the supervisor parses as many bytes and objects as it would in
production: 64 recent step samples per rank. Incremental reads (`/v1/ranks?after=`) follow
the real agent's protocol through the same functions (contract/cursor.py for the cursor
and its validation, service/httpd.py `parse_query` for the query string): one incarnation
and one sample counter per simulated agent. `--full-reads` serves as an agent before cursors did (`after` ignored,
every rank's whole window on every poll), for the benchmark's comparison. Building
answers must stay cheap (this process shares the machine with the supervisor under
test), so each sample is encoded once, when it is first served, and a response is mostly
a string join.

One job ("sim") spans every node, `ranks_per_node` ranks each, all in lockstep as DDP
ranks are. Faults (`--fault-every`) hit a random rank and are logged as JSON lines
(`--fault-log`) with the time of injection:

- `dead`: the rank exits (state "exited", exited_at = now); torchrun tears the group
  down 0.5 s later (every rank exited) and starts a new incarnation after
  `--restart-delay`, resuming from the newest checkpoint step.
- `hang`: the rank is SIGSTOPped (state "stopped") and every rank stops advancing (the
  others wait in the collective); a SIGKILL from the supervisor (`/v1/control/signal`)
  ends it and the group restarts as after a death; without one, after 30 s.

`/v1/rank-events?after=&wait=` (agent/rank_events.py) announces every state change the
simulator makes (a death at once, as a real agent's pidfd watcher does; the teardown's
exits; the new incarnation's ranks) and holds a request with nothing new up to `wait`
seconds; `--no-events` answers it 404, as an agent from before it.

Run: python bench/agent_sim.py --nodes 64 --port 0 --ready-file ready.json
(the ready file gets the port once it serves; SIGTERM stops it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import replace
from pathlib import Path

from rankguard.agent.rank_events import parse_states
from rankguard.contract.answers import API_VERSION as AGENT_API
from rankguard.contract.answers import (
    CollectorStatus,
    MainThreadAnswer,
    NodeAnswer,
    RankAnswer,
    RankEventAnswer,
    RankEventsAnswer,
    RanksAnswer,
    Sample,
    TelemetryStats,
)
from rankguard.contract.cursor import CursorError, Since, answer_fields, new_incarnation, since
from rankguard.contract.telemetry import SPLIT_FIELDS
from rankguard.service.httpd import COMPACT, HttpError, parse_query

JOB = "sim"
RECENT = 64  # the agent's RankTable.recent
EVENT_CAPACITY = 1024  # agent/rank_events.py CAPACITY
MAX_WAIT = 30.0  # agent/rank_events.py MAX_WAIT_SECONDS


def _dumps(value) -> str:
    return json.dumps(value, separators=COMPACT)


class Rank:
    def __init__(self, node: int, local: int, rank: int):
        self.node, self.local, self.rank = node, local, rank
        self.pid = 0
        self.state = "alive"
        self.exited_at: float | None = None
        self.exit_step: int | None = None  # a dead rank reports no more steps
        # recent samples, oldest first: (seq, encoded without seq, encoded with seq)
        self.samples: list[tuple[int, str, str]] = []
        self.sampled_to = -1  # newest step encoded
        self.header: tuple[tuple, str] | None = None  # (cache key, encoded fields)


class Cluster:
    """The simulated job's timeline: incarnations, steps, checkpoints, faults."""

    def __init__(self, nodes: int, ranks_per_node: int, step_seconds: float, ckpt_every: int,
                 restart_delay: float, seed: int, cursors: bool = True):  # fmt: skip
        self.nodes, self.per_node = nodes, ranks_per_node
        self.step_seconds, self.ckpt_every = step_seconds, ckpt_every
        self.restart_delay = restart_delay
        self.rng = random.Random(seed)
        self.world = nodes * ranks_per_node
        self.ranks = [Rank(n, j, n * ranks_per_node + j) for n in range(nodes) for j in range(ranks_per_node)]  # fmt: skip
        self.restart = -1
        self.started = time.time()
        self.node_json = [self._node_fields(n) for n in range(nodes)]
        self.faults_injected = 0
        self.cursors = cursors  # False: answer as an agent before incremental reads
        self.events_on = True  # False: /v1/rank-events is a 404 (an agent before it)
        self.agent_incarnation = [new_incarnation() for _ in range(nodes)]
        self.seq = [0] * nodes  # per simulated agent, as RankTable._seq
        self.events: list[list[RankEventAnswer]] = [[] for _ in range(nodes)]
        self.event_seq = [0] * nodes  # per simulated agent, as RankEventLog._seq
        self.waiting: list[list] = [[] for _ in range(nodes)]  # held requests per node
        self.to_wake: set[int] = set()  # nodes with news for their held requests
        self._new_incarnation(0)

    # -- timeline ---------------------------------------------------------------------
    def _new_incarnation(self, from_step: int) -> None:
        self.restart += 1
        self.base_step, self.inc_start = from_step, time.time()
        self.frozen_step: int | None = None  # set while hung
        self.fault: dict | None = None
        self.next_pid = 100000 + self.restart * self.world
        now = time.time()
        for r in self.ranks:
            previous = None if self.restart == 0 else r.state
            r.pid, r.state, r.exited_at = self.next_pid + r.rank, "alive", None
            r.exit_step = None
            r.samples, r.sampled_to, r.header = [], from_step, None
            if previous is not None:
                self.announce(r, previous, now)

    def step(self, now: float) -> int:
        """The newest completed step of the current incarnation."""
        if self.frozen_step is not None:
            return self.frozen_step
        return self.base_step + int((now - self.inc_start) / self.step_seconds)

    def checkpoint_step(self, now: float) -> int | None:
        s = self.step(now) // self.ckpt_every * self.ckpt_every
        return s if s > 0 else None

    def inject(self, kind: str, now: float) -> dict:
        r = self.rng.choice(self.ranks)
        rec = {"kind": kind, "at": now, "restart": self.restart, "rank": r.rank,
               "node": f"sim-{r.node:04d}", "step": self.step(now)}  # fmt: skip
        if kind == "dead":
            self.exit(r, now)
        else:  # hang: the culprit stopped, everyone stops advancing
            self.frozen_step = self.step(now)
            r.state = "stopped"
        self.fault = {**rec, "culprit": r}
        self.faults_injected += 1
        return rec

    def exit(self, r: Rank, now: float) -> None:
        previous = r.state
        r.state, r.exited_at, r.exit_step = "exited", now, self.step(now)
        self.announce(r, previous, now)

    def announce(self, r: Rank, previous: str, now: float) -> None:
        """A state change, as the agent's RankEventLog records it. The node's held
        requests are answered once the current step of the simulation is done (all of a
        node's teardown exits in one answer, as a real agent's watcher reports the exits
        it finds together); only this node's, as only its agent saw the change."""
        n = r.node
        self.event_seq[n] += 1
        log = self.events[n]
        log.append(RankEventAnswer(self.event_seq[n], JOB, r.rank, r.pid, self.restart,
                                   previous, r.state, now, None, r.exit_step))  # fmt: skip
        del log[:-EVENT_CAPACITY]
        if self.waiting[n] and n not in self.to_wake:
            if not self.to_wake:
                asyncio.get_running_loop().call_soon(self._wake)
            self.to_wake.add(n)

    def _wake(self) -> None:
        nodes, self.to_wake = self.to_wake, set()
        now = time.time()
        for n in nodes:
            waiting, self.waiting[n] = self.waiting[n], []
            # a request filtered by state waits on when none of the news is for it
            self.waiting[n] = [answer for answer in waiting if not answer(now)]

    def news(self, n: int, s: Since, states: frozenset[str] | None) -> bool:
        """An event after the cursor into one of `states` (agent/rank_events.py _news)."""
        for e in reversed(self.events[n]):
            if e.seq <= s.seq:
                return False
            if states is None or e.state in states:
                return True
        return False

    def events_body(self, n: int, now: float, s: Since, states=None) -> bytes:
        """GET /v1/rank-events: as agent/rank_events.py answers it."""
        log, newest = self.events[n], self.event_seq[n]
        full = s.full
        if full is None and log and s.seq + 1 < log[0].seq:
            full = "cursor older than the agent's event buffer (events dropped)"
        events = log if full is not None else [e for e in log if e.seq > s.seq]
        if states is not None:
            events = [e for e in events if e.state in states]
        fields = answer_fields(Since(s.seq, full), self.agent_incarnation[n], newest)
        body = RankEventsAnswer(node=f"sim-{n:04d}", time=now, events=tuple(events), **fields)
        return (_dumps(body.to_json()) + "\n").encode()

    def teardown(self, now: float) -> None:
        for r in self.ranks:
            if r.state != "exited":
                self.exit(r, now)

    def restart_group(self) -> None:
        self._new_incarnation(self.checkpoint_step(time.time()) or 0)

    # -- JSON ---------------------------------------------------------------------------
    def _node_fields(self, n: int) -> dict:
        gpus = [{"index": i, "uuid": f"GPU-sim-{n:04d}-{i}", "name": "NVIDIA H100 80GB HBM3",
                 "lost": False, "utilization_ratio": 0.97, "memory_used_bytes": 61 << 30,
                 "temperature_celsius": 64, "power_watts": 610.0, "xid": {},
                 "ecc_uncorrected": 0} for i in range(self.per_node)]  # fmt: skip
        return {"node": f"sim-{n:04d}", "version": "0.1.0", "status": "healthy",
                "collectors": {c: CollectorStatus(True, 0.002)
                               for c in ("gpu", "host", "network", "ranks", "storage")},
                "facts": {"gpu": {"available": True, "gpus": gpus}}}  # fmt: skip

    def node_body(self, n: int, now: float) -> dict:
        return NodeAnswer(**self.node_json[n], time=now,
                          uptime_seconds=now - self.started).to_json()  # fmt: skip

    def _sample(self, r: Rank, step: int, now: float) -> tuple[int, str, str]:
        # Deterministic jitter per (rank, step): no rank looks like a straggler.
        j = ((r.rank * 7919 + step * 104729) % 1000) / 1000.0
        st = self.step_seconds * (0.98 + 0.04 * j)
        self.seq[r.node] += 1
        seq = self.seq[r.node]
        s = Sample(step, "train", self.restart, r.pid, st, 0.002, st * 0.7, st * 0.25,
                   3.0 / (1 + step / 1000) + 0.01 * j)  # fmt: skip
        return seq, _dumps(s.to_json()), _dumps(replace(s, seq=seq).to_json())

    def rank_text(self, r: Rank, now: float, s: Since | None) -> str:
        step = self.step(now) if r.exit_step is None else r.exit_step
        if r.state == "alive" or r.state == "stopped":
            while r.sampled_to < step:
                r.sampled_to += 1
                r.samples.append(self._sample(r, r.sampled_to, now))
            del r.samples[:-RECENT]
        last_seen = self.inc_start + (step - self.base_step) * self.step_seconds
        key = (step, r.state, round(now - last_seen, 1))  # re-encode at most every 0.1 s
        if r.header is None or r.header[0] != key:
            ckpt = self.checkpoint_step(now)
            st = self.step_seconds
            fields = RankAnswer(
                job=JOB, rank=r.rank, local_rank=r.local, world_size=self.world,
                pid=r.pid, restart=self.restart, process_changes=self.restart,
                state=r.state, source="telemetry", state_since=r.exited_at or self.inc_start,
                exited_at=r.exited_at, first_seen_at=self.inc_start,
                step=step, phase="train",
                heartbeat_age_seconds=max(0.0, now - last_seen),
                last_heartbeat_at=last_seen, timed_step=step, step_seconds=st,
                **dict(zip(SPLIT_FIELDS, (0.002, st * 0.7, st * 0.25, st * 0.05, 0.01, 0.0), strict=True)),
                comm_compute_ratio=0.25 / 0.7,
                tokens_per_second=310000.0, mfu=0.41, loss=3.0 / (1 + step / 1000),
                peak_memory_bytes=61 << 30, checkpoint_step=ckpt,
                cpu_seconds=100.0 + now - self.inc_start,
                cpu_utilization=1.0 if r.state == "alive" else 0.0,
                cpu_active_at=now if r.state == "alive" else self.inc_start,
                records_received=step - self.base_step,
                main_thread=MainThreadAnswer(
                    state="R" if r.state == "alive" else "T",
                    run_seconds=100.0 + now - self.inc_start,
                    active_at=now if r.state == "alive" else self.inc_start,
                    utilization=1.0 if r.state == "alive" else 0.0,
                ),
            ).to_json()  # fmt: skip
            del fields["recent"]  # appended below, as served
            r.header = (key, _dumps(fields)[:-1])  # without the closing brace
        if s is None:  # the legacy answer: the whole window, no sample numbers
            return r.header[1] + ',"recent":[' + ",".join(x[1] for x in r.samples) + "]}"
        first = _dumps(r.samples[0][0] if r.samples else None)
        new = [x[2] for x in r.samples if x[0] > s.seq]
        return r.header[1] + f',"recent_from":{first},"recent":[' + ",".join(new) + "]}"

    def ranks_body(self, n: int, now: float, query: dict[str, str]) -> bytes:
        """GET /v1/ranks[?after=...]: as agent/daemon.py `ranks_view` answers it."""
        after = query.get("after") if self.cursors else None
        ranks = self.ranks[n * self.per_node : (n + 1) * self.per_node]
        inc = self.agent_incarnation[n]
        s = since(after, inc, self.seq[n])  # CursorError: a 400
        texts = [self.rank_text(r, now, s) for r in ranks]  # numbers the new samples
        cursor = {} if s is None else answer_fields(s, inc, self.seq[n])
        frame = _dumps(RanksAnswer(node=f"sim-{n:04d}", time=now, telemetry=TelemetryStats(),
                                   **cursor).to_json())  # fmt: skip
        body = frame.replace('"ranks":[]', '"ranks":[' + ",".join(texts) + "]", 1)
        return (body + "\n").encode()

    def control(self, n: int, path: str, body: dict, now: float) -> dict:
        ranks = {r.rank: r for r in self.ranks[n * self.per_node : (n + 1) * self.per_node]}
        if path.endswith("/stop-job"):
            return {"job": body.get("job"), "launchers": [], "ranks_signalled": []}
        r = ranks.get(int(body.get("rank", -1)))
        if r is None:
            raise LookupError(f"rank {body.get('rank')} is not on this node")
        if path.endswith("/stacks"):
            return {"job": JOB, "rank": r.rank, "pid": r.pid,
                    "stacks": f"Thread {r.pid} (idle)\n    train_step (train.py:1)\n"}  # fmt: skip
        if body.get("signal") == "SIGKILL" and r.state in ("alive", "stopped"):
            self.exit(r, now)
        return {"job": JOB, "rank": r.rank, "pid": r.pid, "signal": body.get("signal")}


class HttpProtocol(asyncio.Protocol):
    """A minimal HTTP/1.1 server with keep-alive, as the real agent's (service/httpd.py)."""

    def __init__(self, cluster: Cluster, stats: dict):
        self.cluster, self.stats = cluster, stats
        self.buf = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.transport.is_closing():
            head, sep, rest = self.buf.partition(b"\r\n\r\n")
            if not sep:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection":
                    close = value.strip().lower() == "close"
            if len(rest) < length:
                return
            self.buf = rest[length:]
            path, _, query = target.partition("?")
            self.respond(method, path, query, rest[:length], close)

    def respond(self, method: str, path: str, query: str, body: bytes, close: bool) -> None:
        now = time.time()
        status, payload = 200, None
        parts = path.strip("/").split("/")  # agents, i, v1, ...
        try:
            n = int(parts[1])
            if parts[0] != "agents" or not 0 <= n < self.cluster.nodes:
                raise ValueError
            route = "/" + "/".join(parts[2:])
            if method == "GET" and route == "/v1/ranks":
                try:
                    payload = self.cluster.ranks_body(n, now, parse_query(query))
                except (HttpError, CursorError) as exc:  # as service/httpd.py answers them
                    status = getattr(exc, "status", 400)
                    payload = {"api": AGENT_API, "error": {"status": status, "message": str(exc)}}
                else:
                    self.stats["ranks_requests"] += 1
                    self.stats["ranks_bytes"] += len(payload)
            elif method == "GET" and route == "/v1/rank-events" and self.cluster.events_on:
                try:
                    q = parse_query(query)
                    wait = float(q.get("wait", "0"))
                    if not 0 <= wait <= MAX_WAIT:
                        raise CursorError(f"wait: {q.get('wait')!r}")
                    states = parse_states(q)
                    s = since(q.get("after") or "start", self.cluster.agent_incarnation[n],
                              self.cluster.event_seq[n])  # fmt: skip
                except (HttpError, CursorError, ValueError) as exc:
                    status = getattr(exc, "status", 400)
                    payload = {"api": AGENT_API, "error": {"status": status, "message": str(exc)}}
                else:
                    self.stats["event_requests"] += 1
                    if s.full is None and wait > 0 and not self.cluster.news(n, s, states):
                        return self.hold(n, s, wait, close, states)
                    payload = self.cluster.events_body(n, now, s, states)
            elif method == "GET" and route == "/v1/node":
                payload = self.cluster.node_body(n, now)
            elif method == "GET" and route == "/healthz":
                payload = {"ok": True}
            elif method == "POST" and route.startswith("/v1/control/"):
                result = self.cluster.control(n, route, json.loads(body or b"{}"), now)
                payload = {"api": AGENT_API, "result": result}
                self.stats["control"] += 1
            else:
                status, payload = 404, {"error": {"status": 404, "message": "not found"}}
        except (ValueError, IndexError, LookupError) as exc:
            status, payload = 404, {"error": {"status": 404, "message": str(exc)}}
        self.send(status, payload, close)

    def hold(self, n: int, s: Since, wait: float, close: bool, states) -> None:
        """A long poll with nothing new (into `states`): answered at the node's next such
        event or after `wait` seconds, whichever is first."""
        done = False

        def answer(now: float, timeout: bool = False) -> bool:
            """True once answered (or gone): no longer held."""
            nonlocal done
            if done or self.transport.is_closing():
                return True
            if not timeout and not self.cluster.news(n, s, states):
                return False
            done = True
            timer.cancel()
            self.send(200, self.cluster.events_body(n, now, s, states), close)
            return True

        timer = asyncio.get_running_loop().call_later(wait, lambda: answer(time.time(), True))
        self.cluster.waiting[n].append(answer)

    def send(self, status: int, payload, close: bool) -> None:
        data = payload if isinstance(payload, bytes) else (_dumps(payload) + "\n").encode()
        self.stats["requests"] += 1
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if close else "")
        self.transport.write((head + "\r\n").encode() + data)
        if close:
            self.transport.close()


async def faults(cluster: Cluster, kinds: list[str], every: float, log_path: Path | None,
                 max_faults: int) -> None:  # fmt: skip
    """Inject one fault every ~`every` seconds (uniform 0.5x..1.5x, so faults land at every
    phase of the supervisor's loop), once the incarnation has run a few checkpoints."""
    out = open(log_path, "a") if log_path else None  # noqa: SIM115 (lives as long as the task)
    i = 0
    while max_faults <= 0 or cluster.faults_injected < max_faults:
        await asyncio.sleep(every * cluster.rng.uniform(0.5, 1.5))
        kind = kinds[i % len(kinds)]
        i += 1
        rec = cluster.inject(kind, time.time())
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
        if kind == "dead":
            await asyncio.sleep(0.5)
        else:  # wait for the supervisor's SIGKILL of the culprit (or give up)
            culprit, deadline = cluster.fault["culprit"], time.time() + 30
            while culprit.state != "exited" and time.time() < deadline:
                await asyncio.sleep(0.05)
            cluster.frozen_step = None
        cluster.teardown(time.time())
        await asyncio.sleep(cluster.restart_delay)
        cluster.restart_group()


async def main(args) -> None:
    cluster = Cluster(args.nodes, args.ranks_per_node, args.step_seconds, args.ckpt_every,
                      args.restart_delay, args.seed, cursors=not args.full_reads)  # fmt: skip
    stats = {"requests": 0, "control": 0, "ranks_requests": 0, "ranks_bytes": 0,
             "event_requests": 0}  # fmt: skip
    cluster.events_on = not args.no_events
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpProtocol(cluster, stats), "127.0.0.1", args.port, backlog=4096
    )
    port = server.sockets[0].getsockname()[1]
    if args.agents_file:
        urls = "".join(f"http://127.0.0.1:{port}/agents/{i}\n" for i in range(args.nodes))
        tmp = Path(str(args.agents_file) + ".tmp")
        tmp.write_text(urls)
        tmp.replace(args.agents_file)
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps({"port": port, "pid": os.getpid()}))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    if args.fault_every > 0:
        kinds = args.faults.split(",")
        tasks.append(asyncio.create_task(
            faults(cluster, kinds, args.fault_every, args.fault_log, args.max_faults)))  # fmt: skip
    await stop.wait()
    for t in tasks:
        t.cancel()
    server.close()
    if args.stats_file:
        Path(args.stats_file).write_text(json.dumps(stats))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.25)
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--restart-delay", type=float, default=3.0)
    p.add_argument("--faults", default="dead", help="comma-separated kinds, used in turn")
    p.add_argument("--fault-every", type=float, default=0.0, help="seconds (0: no faults)")
    p.add_argument("--max-faults", type=int, default=0)
    p.add_argument("--fault-log", type=Path)
    p.add_argument("--agents-file", type=Path, help="write the agents' URLs here")
    p.add_argument("--ready-file", type=Path)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--full-reads",
        action="store_true",
        help="ignore ?after= (an agent before incremental reads)",
    )
    p.add_argument(
        "--no-events", action="store_true", help="answer /v1/rank-events 404 (an agent before it)"
    )
    p.add_argument("--stats-file", type=Path, help="request and byte counts, written at exit")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))

"""deploy/slurm: the scripts parse and pass shellcheck, the prolog/epilog helper keeps a
valid agents file, the sbatch script's launch runs for one node with stub srun and
scontrol (real torchrun, real agent and supervisor), and the control-plane job runs real
etcd members and a supervisor pair that a training job rendezvouses through."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from etcd_cluster import ETCD, SKIP_REASON
from harness import free_port, http_json, start_agent, start_supervisor, wait_until

from rankguard.supervisor.agents import AgentsFile

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy/slurm"
SCRIPTS = sorted(p for p in SLURM.iterdir() if p.is_file())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK)


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _agents(path: Path, action: str, job: str, *nodes: str) -> None:
    env = {**os.environ, "RANKGUARD_AGENTS_FILE": str(path), "RANKGUARD_AGENT_PORT": "9407"}
    subprocess.run([str(SLURM / "rankguard-agents-file"), action, job, *nodes], env=env,
                   check=True, capture_output=True)  # fmt: skip


def test_prolog_epilog_helper_keeps_shared_nodes_until_their_last_job(tmp_path):
    path = tmp_path / "agents"
    path.write_text("# the supervisor's agents\n")
    _agents(path, "add", "101", "n1", "n2")
    _agents(path, "add", "102", "n2", "n3")
    assert AgentsFile(path).urls() == ["http://n1:9407", "http://n2:9407", "http://n3:9407"]
    _agents(path, "remove", "101", "n1", "n2")
    text = path.read_text()
    assert text.startswith("# the supervisor's agents\n")
    assert AgentsFile(path).urls() == ["http://n2:9407", "http://n3:9407"]  # n2: job 102
    _agents(path, "add", "102", "n3")  # a repeated prolog adds nothing twice
    assert path.read_text().count("http://n3:9407") == 1
    _agents(path, "remove", "102", "n2", "n3")
    assert AgentsFile(path).urls() == []


def test_concurrent_prologs_lose_no_node(tmp_path):
    path = tmp_path / "agents"
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _agents(path, "add", "7", f"node{i:02d}"), range(16)))
    assert sorted(AgentsFile(path).urls()) == [f"http://node{i:02d}:9407" for i in range(16)]


def _stubs(tmp_path: Path) -> Path:
    """srun runs the command here (and notes the supervisor URL its steps see); scontrol
    lists the node list's hosts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)  # the same stubs for every script of a test
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n# test stub: drop the options, run the command on this host\n"
        f'echo "${{RANKGUARD_SUPERVISOR:-unset}}" >>{tmp_path}/srun-supervisor\n'
        'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && tr "," "\\n" <<<"$3"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return bin_dir


def _one_node_env(tmp_path: Path, agent, job_id: str, **variables: str) -> dict:
    """What the batch script sees on a one-node job ("localhost", two ranks) whose node
    runs `agent`: the stubs first on PATH, this rankguard and Python, the job's folder;
    `variables` add to it (the supervisor's port, or a running supervisor's URL)."""
    return {
        **os.environ,
        "PATH": f"{_stubs(tmp_path)}:{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
        "RANKGUARD": str(Path(sys.executable).with_name("rankguard")), "PYTHON": sys.executable,
        "RANKGUARD_DIR": str(tmp_path / "job"),
        "RANKGUARD_AGENT_PORT": agent.url.rsplit(":", 1)[1],
        "RANKGUARD_TOKEN_FILE": str(tmp_path / "token"),
        "RANKGUARD_TELEMETRY_SOCKET": str(agent.socket),
        "RDZV_PORT": str(free_port()), "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1",
        **variables,
    }  # fmt: skip


TRAINER_ARGS = ("--preset", "tiny", "--steps", "20", "--log-every", "0")


def _sbatch(
    tmp_path: Path, env: dict, timeout: float = 240, args: tuple[str, ...] = TRAINER_ARGS
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SLURM / "rankguard-train.sbatch"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("args", [("--",), ("--", "-m"), ("--", "--steps", "5")])
def test_sbatch_refuses_a_dashdash_without_a_script(tmp_path, args):
    env = {**os.environ, "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1",
           "RANKGUARD_DIR": str(tmp_path / "job")}  # fmt: skip
    proc = _sbatch(tmp_path, env, timeout=30, args=args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "-- train.py [ARGS...]" in proc.stderr
    assert not (tmp_path / "job").exists()  # refused before anything was made


@pytest.mark.slow
def test_sbatch_runs_your_own_script_after_dashdash(tmp_path):
    """`-- SCRIPT ARGS`: torchrun runs the user's script instead of the bundled trainer,
    watched zero-code by the node's agent, with the job's own supervisor."""
    agent = start_agent(tmp_path, "localhost")
    env = _one_node_env(tmp_path, agent, "4444", RANKGUARD_SUPERVISOR_PORT=str(free_port()))
    script = str(ROOT / "examples" / "ddp_plain.py")
    try:
        proc = _sbatch(tmp_path, env, args=("--", script, "--steps", "20", "--width", "32"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert f"--max-restarts 10 {script} --steps 20 --width 32" in proc.stdout, proc.stdout
        assert "rankguard.trainer" not in proc.stdout
        ranks = http_json(agent.url + "/v1/ranks")["ranks"]
        seen = sorted((r["job"], r["rank"], r["state"], r["source"]) for r in ranks)
        assert seen == [("4444", 0, "finished", "process"), ("4444", 1, "finished", "process")]
    finally:
        agent.stop()


@pytest.mark.parametrize("value", ["job", "none", "localhost:9408"])
def test_sbatch_refuses_a_supervisor_variable_that_is_not_a_url(tmp_path, value):
    """RANKGUARD_SUPERVISOR has the CLI's meaning (a URL); the old job|none switch is
    RANKGUARD_SUPERVISOR_MODE now, and the old values stop the script with one line."""
    env = {**os.environ, "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1",
           "RANKGUARD_DIR": str(tmp_path / "job"), "RANKGUARD_SUPERVISOR": value}  # fmt: skip
    proc = _sbatch(tmp_path, env, timeout=30)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "RANKGUARD_SUPERVISOR_MODE" in proc.stderr and "Traceback" not in proc.stderr
    both = {**env, "RANKGUARD_SUPERVISOR": "http://head:9408", "RANKGUARD_SUPERVISOR_MODE": "job"}
    assert _sbatch(tmp_path, both, timeout=30).returncode == 2
    bad_mode = {**env, "RANKGUARD_SUPERVISOR_MODE": "cluster"}
    bad_mode.pop("RANKGUARD_SUPERVISOR")
    proc = _sbatch(tmp_path, bad_mode, timeout=30)
    assert proc.returncode == 2 and "job or none" in proc.stderr


@pytest.mark.slow
def test_sbatch_uses_an_exported_supervisor_url(tmp_path):
    """A running (cluster-wide) supervisor exported as RANKGUARD_SUPERVISOR: the script
    starts none of its own, the job's steps see the URL, and that supervisor watched the
    job to its end."""
    agent = start_agent(tmp_path, "localhost")
    supervisor = start_supervisor(tmp_path, [agent.url])
    env = _one_node_env(tmp_path, agent, "4343", RANKGUARD_SUPERVISOR=supervisor.url)
    try:
        proc = _sbatch(tmp_path, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert f"supervisor {supervisor.url} (RANKGUARD_SUPERVISOR; none started" in proc.stdout
        assert f"incidents --supervisor {supervisor.url}" in proc.stdout
        assert not (tmp_path / "job" / "supervisor.log").exists()
        seen = set((tmp_path / "srun-supervisor").read_text().split())
        assert seen == {supervisor.url}, seen  # every step (rendezvous, training) saw it
        job = http_json(supervisor.url + "/v1/cluster")["jobs"]["slurm-4343"]
        assert (job["state"], job["max_step"]) == ("finished", 20), job
    finally:
        supervisor.stop()
        agent.stop()


@pytest.mark.slow
def test_sbatch_launches_torchrun_with_the_agent_and_supervisor(tmp_path):
    """One node: the script's srun calls run here (stub), torchrun rendezvous through
    `rankguard rendezvous` started as a step on the "first node", the trainer's telemetry reaches the node's agent, and the job's
    supervisor is started on its agents file and stopped at the end."""
    agent = start_agent(tmp_path, "localhost")
    sup_port, agent_port = free_port(), int(agent.url.rsplit(":", 1)[1])
    env = _one_node_env(tmp_path, agent, "4242", RANKGUARD_SUPERVISOR_PORT=str(sup_port))
    try:
        proc = _sbatch(tmp_path, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        # the job's own supervisor, and its steps see its URL
        sup_url = f"http://localhost:{sup_port}"
        assert set((tmp_path / "srun-supervisor").read_text().split()) == {"unset", sup_url}
        assert (
            "--nnodes 1:1 --nproc-per-node 2 --rdzv-backend rankguard --rdzv-endpoint localhost:"
            in proc.stdout
        )
        ranks = http_json(agent.url + "/v1/ranks")["ranks"]
        assert sorted((r["job"], r["rank"], r["state"], r["step"]) for r in ranks) == [
            ("slurm-4242", 0, "finished", 20),
            ("slurm-4242", 1, "finished", 20),
        ]
        job = tmp_path / "job"
        assert (job / "agents").read_text() == f"http://localhost:{agent_port}\n"
        log = (job / "supervisor.log").read_text()
        assert f"supervisor on http://0.0.0.0:{sup_port}" in log
        assert "agents file" in log and "1 agents" in log
        assert (job / "rankguard.db").exists()
        # the job's folder and its rendezvous secret are the user's alone, and torchrun signs
        # the rendezvous state with that secret
        assert stat.S_IMODE(job.stat().st_mode) == 0o700
        assert stat.S_IMODE((job / "rendezvous.key").stat().st_mode) == 0o600
        assert f"--rdzv-conf secret_file={job / 'rendezvous.key'}" in proc.stdout
        # the rendezvous store ran as its own step, and was stopped with the job
        assert "rendezvous store listening on port" in (job / "rendezvous.log").read_text()
        assert "rendezvous store on localhost:" in proc.stdout
    finally:
        agent.stop()


# -- the control plane job: etcd members and a supervisor pair ---------------------------

CONTROL = SLURM / "rankguard-control.sbatch"


def _control_env(tmp_path: Path, bin_dir: Path, agents_file: Path, **variables: str) -> dict:
    """Three "nodes" on this host: 127.0.0.1, .2 and .3 (their names are their loopback
    addresses, so each listens on its own address with the same ports, as nodes would)."""
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "5151", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2,127.0.0.3",
        "RANKGUARD": str(Path(sys.executable).with_name("rankguard")), "PYTHON": sys.executable,
        "ETCD": ETCD or "/usr/bin/etcd",
        "RANKGUARD_DIR": str(tmp_path / "control"),
        "RANKGUARD_ETCD_DATA": str(tmp_path / "etcd-data"),
        "ETCD_CLIENT_PORT": str(free_port()), "ETCD_PEER_PORT": str(free_port()),
        "RANKGUARD_SUPERVISOR_PORT": str(free_port()),
        "RANKGUARD_AGENTS_FILE": str(agents_file),
        "RANKGUARD_TOKEN_FILE": str(tmp_path / "token"),
        **variables,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("variables", "named"),
    [({"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2"}, "need as many nodes"),
     ({"RANKGUARD_ETCD_MEMBERS": "4"}, "RANKGUARD_ETCD_MEMBERS must be 3 or 5"),
     ({"RANKGUARD_SUPERVISORS": "1"}, "RANKGUARD_SUPERVISORS must be 2 or 3"),
     ({"RANKGUARD_AGENTS_FILE": "/nonexistent/agents"}, "does not exist"),
     ({"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2,192.0.2.7"}, "resolve to loopback"),
     ({"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2,no-such-node.invalid"}, "cannot resolve")],
)  # fmt: skip
def test_control_job_refuses_what_it_cannot_run(tmp_path, variables, named):
    agents = tmp_path / "agents"
    agents.write_text("")
    env = _control_env(tmp_path, _stubs(tmp_path), agents, **variables)
    proc = subprocess.run([str(CONTROL)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "control").exists()  # refused before anything started


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
def test_control_job_runs_etcd_and_a_supervisor_pair_that_a_training_job_uses(tmp_path):
    """The control job on three "nodes" (stub srun and scontrol; real etcd, real
    supervisors): it writes the etcd endpoint once the members answer and the
    supervisors' URLs; one supervisor leads, the other names it; a member killed is
    started again on its node; a training job (rankguard-train.sbatch, real torchrun)
    given the endpoint and a supervisor rendezvouses in etcd and both supervisors see it
    finish; scancel's SIGTERM stops every service. Not run here: a Slurm controller, nodes
    that are different hosts (three loopback addresses of one)."""
    from rankguard.service.etcd import EtcdClient, parse_endpoints

    if ETCD is None:
        pytest.skip(SKIP_REASON)
    agent = start_agent(tmp_path, "localhost")
    agents = tmp_path / "agents"
    agents.write_text(f"{agent.url}\n")
    bin_dir = _stubs(tmp_path)
    env = _control_env(tmp_path, bin_dir, agents)
    control = tmp_path / "control"
    with open(tmp_path / "control.out", "w") as out:
        job = subprocess.Popen([str(CONTROL)], cwd=tmp_path, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def output() -> str:
        return (tmp_path / "control.out").read_text()[-4000:]

    try:
        endpoint = wait_until(lambda: (control / "etcd-endpoint").read_text().strip(), 120,
                              "the control job's etcd-endpoint file")  # fmt: skip
        port = env["ETCD_CLIENT_PORT"]
        assert endpoint == f"etcd://127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}"
        client = EtcdClient(parse_endpoints(endpoint), timeout=10)
        client.put(b"rankguard/test", b"ok")
        urls = wait_until(lambda: (control / "supervisors").read_text().split(), 30,
                          "the supervisors file")  # fmt: skip
        sup_port = env["RANKGUARD_SUPERVISOR_PORT"]
        assert urls == [f"http://127.0.0.1:{sup_port}", f"http://127.0.0.2:{sup_port}"]

        def leaders() -> list | None:
            views = [http_json(u + "/v1/cluster", timeout=2)["leadership"] for u in urls]
            return views if all(v["leader"] for v in views) else None

        views = wait_until(leaders, 60, "both supervisors naming a leader " + output())
        assert sorted(v["name"] for v in views) == ["127.0.0.1", "127.0.0.2"]
        assert [v["leading"] for v in views].count(True) == 1
        assert len({v["leader"] for v in views}) == 1, views

        # a member that dies is started again on its node, with its data
        (member,) = [p for p in _descendants(job.pid)
                     if p.name() == "etcd" and "127.0.0.3" in p.cmdline()]  # fmt: skip
        member.kill()
        assert client.get(b"rankguard/test").value == b"ok"  # two of three serve
        wait_until(lambda: [p for p in _descendants(job.pid)
                            if p.name() == "etcd" and "127.0.0.3" in p.cmdline()
                            and p.pid != member.pid], 30, "the member started again")  # fmt: skip
        assert "etcd 127.0.0.3 on 127.0.0.3 ended; starting it again in 5 s" in output()

        # a training job meets in etcd and is watched by the pair
        train_env = _one_node_env(tmp_path, agent, "5252", RANKGUARD_RENDEZVOUS=endpoint,
                                  RANKGUARD_SUPERVISOR=urls[0])  # fmt: skip
        proc = _sbatch(tmp_path, train_env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert f"--rdzv-endpoint {endpoint}" in proc.stdout
        assert "rendezvous store on" not in proc.stdout  # no c10d store started
        assert client.count(b"rankguard/rdzv/5252/") > 0
        for url in urls:
            seen = wait_until(lambda url=url: http_json(url + "/v1/cluster")["jobs"].get(
                "slurm-5252", {}).get("state") == "finished", 30, f"{url} seeing the job")  # fmt: skip
            assert seen
    finally:
        if job.poll() is None:
            job.terminate()  # scancel's SIGTERM to the batch script
        try:
            assert job.wait(timeout=30) == 0, output()
        finally:
            for p in _descendants(job.pid) if job.poll() is None else []:
                p.kill()
            agent.stop()
    for i in (1, 2, 3):  # every service stopped with the job
        with pytest.raises(OSError):
            http_json(f"http://127.0.0.{i}:{env['ETCD_CLIENT_PORT']}/health", timeout=1)

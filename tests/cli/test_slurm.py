"""deploy/slurm: the scripts parse and pass shellcheck, the prolog/epilog helper keeps a
valid agents file, and the sbatch script's launch runs for one node with stub srun and
scontrol (real torchrun, real agent and supervisor)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import free_port, http_json, start_agent, start_supervisor

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
    bin_dir.mkdir()
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

"""deploy/slurm: the scripts parse and pass shellcheck, the prolog/epilog helper keeps a
valid agents file, and the sbatch script's launch runs for one node with stub srun and
scontrol (real torchrun, real agent and supervisor)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import free_port, http_json, start_agent

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


@pytest.mark.slow
def test_sbatch_launches_torchrun_with_the_agent_and_supervisor(tmp_path):
    """One node: the script's srun calls run here (stub), torchrun rendezvous through
    `rankguard rendezvous` started as a step on the "first node", the trainer's telemetry reaches the node's agent, and the job's
    supervisor is started on its agents file and stopped at the end."""
    agent = start_agent(tmp_path, "localhost")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n# test stub: drop the options, run the command on this host\n"
        'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && tr "," "\\n" <<<"$3"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    sup_port, agent_port = free_port(), int(agent.url.rsplit(":", 1)[1])
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "RANKGUARD": str(Path(sys.executable).with_name("rankguard")),
        "PYTHON": sys.executable,
        "RANKGUARD_DIR": str(tmp_path / "job"),
        "RANKGUARD_AGENT_PORT": str(agent_port),
        "RANKGUARD_SUPERVISOR_PORT": str(sup_port),
        "RANKGUARD_TOKEN_FILE": str(tmp_path / "token"),
        "RANKGUARD_TELEMETRY_SOCKET": str(agent.socket),
        "RDZV_PORT": str(free_port()),
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
    }
    try:
        proc = subprocess.run(
            [str(SLURM / "rankguard-train.sbatch"), "--preset", "tiny", "--steps", "20",
             "--log-every", "0"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
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
        # the rendezvous store ran as its own step, and was stopped with the job
        assert "rendezvous store listening on port" in (job / "rendezvous.log").read_text()
        assert "rendezvous store on localhost:" in proc.stdout
    finally:
        agent.stop()

"""Where the agent's time goes under the overhead bench's load (issue 16's profile).

    python bench/agent_profile.py PYTHON RATE OUT_DIR

Starts the agent of interpreter PYTHON (this venv's, or another venv's: an older commit)
with 8 senders at RATE records/s each, as bench/agent_overhead.py does, then prints each
thread's CPU share and wake-ups (voluntary context switches) over 10 s, and writes py-spy's
raw stacks (OUT_DIR/pyspy.txt) and `strace -c` of the receiver thread (OUT_DIR/strace.txt).
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import agent_overhead as ao  # noqa: E402


def main() -> None:
    py, rate, out = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rg-prof-") as tmp:
        agent, _, sock = ao.start_agent(Path(tmp), 8, python=py)
        senders = [
            subprocess.Popen([sys.executable, "-c", ao.SENDER, str(sock), str(r), str(rate)])
            for r in range(8)
        ]
        try:
            time.sleep(3)
            names = ao.thread_names(agent.pid)
            rx = next(t for t, n in names.items() if "receiver" in n)
            c0 = ao.thread_cpu(agent.pid)
            s0 = {t: ao.thread_switches(agent.pid, t) for t in c0}
            t0 = time.monotonic()
            time.sleep(10)
            c1 = ao.thread_cpu(agent.pid)
            s1 = {t: ao.thread_switches(agent.pid, t) for t in c1}
            el = time.monotonic() - t0
            for t in sorted(c1):
                cpu, wakes = 100 * (c1[t] - c0.get(t, 0)) / el, (s1[t] - s0.get(t, 0)) / el
                print(f"{names.get(t, '?'):40s} cpu {cpu:6.3f}%  wakeups/s {wakes:7.1f}")
            spy = str(Path(sys.executable).with_name("py-spy"))
            subprocess.run([spy, "record", "-p", str(agent.pid), "-d", "10", "-r", "250",
                            "--threads", "--native", "-f", "raw", "-o", str(out / "pyspy.txt")],
                           capture_output=True)  # fmt: skip
            st = subprocess.run(
                ["timeout", "10", "strace", "-c", "-p", str(rx)], capture_output=True, text=True
            )
            (out / "strace.txt").write_text(st.stderr)
        finally:
            for s in senders:
                s.kill()
            agent.terminate()
            agent.wait()


if __name__ == "__main__":
    main()

"""A 2-rank gloo job (torchrun, CPU) for test_flight_recorder.py: steps flow, then the job
hangs the way a real one does. Rank 1 issues one all-reduce more than rank 0 and blocks
in it; rank 0, the culprit, sleeps (stuck in its own code) for STALL seconds, then joins
it and the job ends well. Each rank's Reporter (built before the process group, so it
turns the recorder on) sends to SOCKET; a thread of each rank reads the wavefront itself
READ_AT seconds into the stall and writes it to ``OUT/rank<r>.json``.

    torchrun --standalone --nproc-per-node=2 flight_recorder_job.py OUT SOCKET
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rankguard.client import Reporter
from rankguard.client.flight_recorder import read_wavefront

STEPS = 12
STEP_SLEEP = 0.05  # steps flow: far below the 1 s a stall needs
STALL = 4.0  # seconds rank 0 is stuck while rank 1 waits in the extra all-reduce
READ_AT = 1.5  # seconds into the stall the job's own thread reads the wavefront


def main() -> None:
    out, sock = Path(sys.argv[1]), sys.argv[2]
    rg = Reporter(socket_path=sock, heartbeat_seconds=0)  # before the group: enables
    assert os.environ.get("TORCH_FR_BUFFER_SIZE") == "2000"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = dist.new_group([0, 1], group_desc="pair")
    t = torch.ones(4)
    for n in range(1, STEPS + 1):
        with rg.step(n):
            dist.all_reduce(t)
            time.sleep(STEP_SLEEP)
    dist.all_reduce(t, group=pair)

    def read_later() -> None:
        time.sleep(READ_AT)
        front = read_wavefront()
        (out / f"rank{rank}.json").write_text(json.dumps([c.to_json() for c in front]))

    reader = threading.Thread(target=read_later)
    reader.start()
    if rank == 1:
        dist.all_reduce(torch.ones(2, 3))  # one more than rank 0 has issued: blocks
    else:
        time.sleep(STALL)  # the culprit: stuck outside any collective
        dist.all_reduce(torch.ones(2, 3))  # ... until it joins, and the job ends well
    reader.join()
    rg.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

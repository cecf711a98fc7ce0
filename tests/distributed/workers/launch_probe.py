"""Cheap workers for raf_dist.run's tests. Usage: launch_probe.py MODE

  info     allreduce of rank + 1; print this rank's communicator fields and the sum as JSON
  sleep    join the world, print 'rank R: running pid P', then sleep (ended by the launcher)
  nojoin   rank 1 never calls get_communicator (sleeps); the others must time out naming it
  fail     join, then rank 1 exits with code 3
  kill     join, then rank 1 SIGKILLs itself"""
import json
import os
import signal
import sys
import time

import numpy as np

from raf_dist import distributed as dist


def main(mode):
    if mode == "nojoin" and os.environ.get("RANK") == "1":
        time.sleep(600)
    comm = dist.get_communicator()
    if mode == "info":
        total = dist.allreduce(np.full(3, comm.rank + 1.0, dtype=np.float32))
        print("INFO " + json.dumps({
            "rank": comm.rank, "size": comm.size, "local_rank": comm.local_rank,
            "local_size": comm.local_size, "sum": float(total[0]), "host": comm.host,
            "env_rank": int(os.environ["RANK"]), "node": int(os.environ["GROUP_RANK"])}),
            flush=True)
    elif mode == "sleep":
        print(f"rank {comm.rank}: running pid {os.getpid()}", flush=True)
        time.sleep(600)
    elif mode in ("fail", "kill"):
        dist.barrier()
        if comm.rank == 1:
            sys.exit(3) if mode == "fail" else os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1])

"""A rank catches a collective's TimeoutError and then ends its program normally, while the
communication thread is still inside the MPI call that will never complete (rank 1 stalls).
Exit must not wait for that thread or in MPI_Finalize: the rank leaves with status 1 at once
(the job failed), and rank 1's watchdog, told of the failure, ends rank 1. Before, exit
joined the stuck thread and the job hung."""
import time

import numpy as np

from raf_dist import distributed as dist

comm = dist.get_communicator()
dist.allreduce(np.ones(4, np.float32))
if comm.rank == 1:
    time.sleep(120)  # alive and silent
try:
    dist.allreduce(np.ones(4, np.float32))  # never matched
except Exception as exc:  # the script decides to stop here, "cleanly"
    print(f"rank {comm.rank}: caught {type(exc).__name__}: {str(exc).splitlines()[0][:80]}",
          flush=True)

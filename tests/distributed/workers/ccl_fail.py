"""Rank 1 raises after the first collective while the others block in the next one: the whole
job must end, non-zero, naming the failing rank."""
import numpy as np

from raf_dist import distributed as dist

comm = dist.get_communicator()
dist.allreduce(np.ones(4, np.float32))
if comm.rank == 1:
    raise ValueError("deliberate failure on rank 1")
dist.allreduce(np.ones(4, np.float32))  # never matched: rank 1 is gone

"""With RAF_DIST_CHECK_COLLECTIVES=1, ranks that issue different collectives must get an error
naming the ranks and both signatures, not a hang or corrupted data.
Argument: 'count' (same kind, different sizes), 'kind' (allreduce vs allgather) or 'splits'
(alltoallv whose send and receive counts do not pair up)."""
import sys

import numpy as np

from raf_dist import distributed as dist

comm = dist.get_communicator()
dist.allreduce(np.ones(4, np.float32))  # a matching call first: sequence numbers advance
try:
    if sys.argv[1] == "count":
        dist.allreduce(np.ones(10 + comm.rank, np.float32))
    elif sys.argv[1] == "splits":  # every rank sends 2 to each, but rank 0 expects 3 from each
        expect = [3 if comm.rank == 0 else 2] * comm.size
        dist.alltoallv(np.ones(2 * comm.size, np.float32), [2] * comm.size, expect)
    elif comm.rank == 0:
        dist.allreduce(np.ones(8, np.float32))
    else:
        dist.allgather(np.ones(8 // comm.size, np.float32))
except RuntimeError as err:
    sys.stdout.write(f"rank {comm.rank} MISMATCH: {err}\n".replace("\n", " | ") + "\n")
    sys.stdout.flush()
    sys.exit(0)
print(f"rank {comm.rank}: no error raised")
sys.exit(3)

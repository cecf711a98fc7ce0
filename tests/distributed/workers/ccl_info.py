"""Print this rank's communicator fields as JSON (one line per rank)."""
import json

from raf_dist import distributed as dist

comm = dist.get_communicator()
print("INFO " + json.dumps({"rank": comm.rank, "size": comm.size, "local_rank": comm.local_rank,
                            "local_size": comm.local_size, "host": comm.host}))

"""Build and step a data-parallel Trainer, then report (rank 0 prints one JSON line per rank) the affinity
the process had before, what every thread of the process may run on afterwards, and what a
thread the user starts afterwards may run on (tests/distributed/test_affinity.py)."""
import json
import os
import sys
import threading
from pathlib import Path

before = sorted(os.sched_getaffinity(0))  # before raf_dist or TVM is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import MLP  # noqa: E402

import raf_dist  # noqa: E402
from raf_dist import distributed as dist  # noqa: E402

dist.get_config().enable_data_parallel = True
comm = dist.get_communicator()
torch.manual_seed(0)
x = np.random.default_rng(comm.rank).standard_normal((8, 20)).astype("float32")
y = np.arange(8, dtype="int64") % 5
trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(MLP(), (torch.from_numpy(x),)),
                           optimizer=raf_dist.optim.SGD(lr=0.1))
trainer.step(x, y)  # the first parallel kernel (re)configures TVM's pool lazily too

user_thread = {}
thread = threading.Thread(target=lambda: user_thread.update(cpus=sorted(os.sched_getaffinity(0))))
thread.start()
thread.join()


def thread_cpus():
    """Cpus_allowed_list of every thread of this process (TVM's workers, MPI's, ours). A thread
    may end between the listing and the read (seen in CI: a short-lived helper thread); a
    thread that no longer exists cannot be pinned, so it is left out."""
    cpus = {}
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cpus[status.parent.name] = line.split(":", 1)[1].strip()
    return cpus


report = {"rank": comm.rank, "before": before, "main_after": sorted(os.sched_getaffinity(0)),
          "user_thread": user_thread["cpus"], "threads": thread_cpus()}
# rank 0 prints every rank's report: lines printed by two ranks at once can interleave in the
# launcher's merged output (seen: one rank's JSON glued to the other's)
reports = comm.mpi_comm.gather(report, root=0)
if comm.rank == 0:
    for item in reports:
        print("AFFINITY " + json.dumps(item), flush=True)

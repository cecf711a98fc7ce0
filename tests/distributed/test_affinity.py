"""raf_dist never changes the user's CPU affinity (docs: compiler/threads.py): after a Trainer
is built and stepped under `mpiexec -n 2`, every thread of each rank — the user's main thread,
a thread the user starts afterwards, TVM's workers — may still run on every core the process
had. (TVM's thread pool bound the calling thread to core 0 before: both ranks computed on
core 0.)"""
import json
import os
import re

from mpi_launch import check_mpi


def _cpu_list(text):
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def test_trainer_leaves_affinity_alone():
    out = check_mpi("affinity.py", 2, timeout=240)
    reports = [json.loads(line) for line in re.findall(r"AFFINITY (.*)", out)]
    assert sorted(r["rank"] for r in reports) == [0, 1], out
    for report in reports:
        had = set(report["before"])
        assert had == os.sched_getaffinity(0), "the launcher itself changed the affinity"
        assert set(report["main_after"]) == had, report
        assert set(report["user_thread"]) == had, report
        pinned = {tid: cpus for tid, cpus in report["threads"].items() if _cpu_list(cpus) != had}
        assert not pinned, f"rank {report['rank']}: threads bound to fewer cores: {pinned}"

"""What a collective costs when its ranks come to it from compute, with N ranks on this host.

    python bench/meeting_cost.py [--ranks 2,4,8] [--sizes 128,256,384] [--seconds 1.5]

Each rank repeats a compute chunk (8 float32 GEMMs of SIZE^3 on numpy's BLAS, with the
threads a Trainer gives a rank: cores / ranks on the host) either alone or followed by a
4 KiB raf_dist allreduce, for the same number of iterations on every rank (fixed from a
first timed chunk, the slowest rank's), in one ``mpiexec -n N`` job per N (bench/harness.py,
killed past its timeout). The slowest rank's time per iteration with the allreduce, less
without it, is the *meeting cost*: what waiting for the members of a collective adds once
the ranks arrive from compute instead of from a barrier. ``proxies calibrate`` measures the
allreduce between barriers (every rank already waiting: 19 us per ring step with 8 ranks on
2 cores); a step's collectives are met from compute. With more ranks than cores the ranks
take turns on the cores, each a different share of each chunk, so the last one arrives late
by a part of the scheduler's period, and the waiting ranks' polling takes turns with the
computing ones (#33: every 8-rank mesh of bench/plan_validation.py predicted 33-59% too
fast). Prints per N and chunk: compute ms per iteration, with the allreduce, the meeting cost
and its ratio to the chunk.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def side(sizes, seconds):
    from mpi4py import MPI

    from raf_dist.distributed import get_communicator
    from raf_dist.proxies.calibrate import meeting_times
    from raf_dist.runtime.threads import set_num_threads, threads_per_rank

    comm = MPI.COMM_WORLD
    set_num_threads(threads_per_rank(get_communicator().local_size))
    rows = [{"size": size, "compute_ms": compute * 1e3, "meet_ms": meet * 1e3}
            for size, (compute, meet) in zip(sizes, meeting_times(comm, sizes, seconds))]
    if comm.rank == 0:
        harness.report({"ranks": comm.size, "rows": rows})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", action="store_true")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--sizes", default="128,256,384")
    p.add_argument("--seconds", type=float, default=1.5)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.side:
        side(sizes, a.seconds)
        return
    print(f"# {harness.machine()}; chunk = 8 float32 GEMMs of SIZE^3 per iteration; slowest "
          "rank; best of 2")
    print(f"{'ranks':>5} {'size':>5} {'compute ms':>11} {'+allreduce ms':>14} "
          f"{'meeting ms':>11} {'/ chunk':>8}")
    for n in (int(r) for r in a.ranks.split(",")):
        got = harness.run_side([harness.mpiexec(), "-n", str(n), sys.executable, __file__,
                                "--side", "--sizes", a.sizes, "--seconds", str(a.seconds)],
                               timeout=600)
        for row in got["rows"]:
            meeting = row["meet_ms"] - row["compute_ms"]
            print(f"{n:>5} {row['size']:>5} {row['compute_ms']:>11.2f} {row['meet_ms']:>14.2f} "
                  f"{meeting:>11.2f} {meeting / row['compute_ms']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()

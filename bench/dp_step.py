"""Data-parallel step time: raf_dist vs PyTorch DDP (gloo, default 25 MB buckets), each alone.

    python bench/dp_step.py [--np 2] [--model mlp|gpt|all] [--steps 10] [--rounds 3]
                             [--peer eager|compile]

Models are bench/step_time.py's (MLP batch 128, GPT batch 16), AdamW; each rank takes
global_batch / N rows. Each side is its own `mpiexec -n N` job (bench/harness.py), the sides
alternating for ``--rounds`` rounds. Threads per rank are the same for both: cores / ranks
(raf_dist's default, and what torchrun's OMP_NUM_THREADS=1 default gives on this machine).
A step's time is the slowest rank's (barrier before each step); medians over steps. Also
printed: raf_dist's one-process step on the global batch (all cores), for the speedup.
``--pin-ranks`` adds a raf_dist side whose ranks are bound to disjoint core sets by local rank
(the alternative to raf_dist's default of binding nothing; compiler/threads.py).

    mpiexec -n 2 python bench/dp_step.py --side raf|ddp --model gpt   one side, one BENCH line
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import step_time  # noqa: E402


def _slowest_rank(mpi_comm):
    from mpi4py import MPI

    def timer(fn):
        mpi_comm.Barrier()
        start = time.perf_counter()
        fn()
        return mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return timer


def _local_rows(name, rank, size):
    module, x, y = step_time.make(name)
    local = x.shape[0] // size
    return module, x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]


def raf_side(name, steps, cache_dir, pin=False):
    import raf_dist
    from raf_dist import distributed as dist

    comm = dist.get_communicator()
    if pin:  # disjoint core sets by local rank, bound before any thread pool starts
        mine = sorted(os.sched_getaffinity(0))
        per_rank = max(1, len(mine) // comm.local_size)
        start = (comm.local_rank * per_rank) % len(mine)
        os.sched_setaffinity(0, set(mine[start:start + per_rank]))
    module, xs, ys = _local_rows(name, comm.rank, comm.size)
    dist.get_config().enable_data_parallel = comm.size > 1
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    xn, yn = xs.numpy(), ys.numpy()
    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps,
                           timer=_slowest_rank(comm.mpi_comm))
    return {"ms": ms, "ranks": comm.size}


def ddp_side(name, steps, peer="eager"):
    import torch
    import torch.distributed as tdist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    # torchrun's default for several workers per node is OMP_NUM_THREADS=1; on this 2-core
    # machine with 2 ranks that is also cores / local ranks, raf_dist's default
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local.size))
    port = world.bcast(29500 + os.getpid() % 1000 if world.rank == 0 else None, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                             world_size=world.size)
    module, xs, ys = _local_rows(name, world.rank, world.size)
    ddp = DistributedDataParallel(module)  # default 25 MB buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def loss_of(m):  # DDP, then torch.compile of the DDP module (PyTorch's order) on "compile"
        out = m(xs)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ys.reshape(-1))

    step, _, first_s = harness.torch_peer_step(ddp, opt, loss_of, peer)
    ms = harness.median_ms(step, steps, timer=_slowest_rank(world))
    tdist.destroy_process_group()
    return {"ms": ms, "threads": torch.get_num_threads(), "first_step_s": first_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin-ranks", action="store_true",
                        help="also time raf_dist with ranks bound to disjoint core sets")
    parser.add_argument("--peer", default="eager", choices=harness.PEERS,
                        help="DDP eager (default) or DDP then torch.compile (Inductor)")
    parser.add_argument("--side", choices=["raf", "raf-pinned", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = (ddp_side(args.model, args.steps, args.peer) if args.side == "ddp" else
                  raf_side(args.model, args.steps, args.cache_dir, pin=args.side == "raf-pinned"))
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 0:
            harness.report(result)
        return

    import torch
    names = ["mlp", "gpt"] if args.model == "all" else [args.model]
    print(f"# {args.np} ranks, torch {torch.__version__} DDP/gloo; {harness.machine()}; each side "
          f"alone, {args.rounds} alternating rounds of {args.steps} steps (slowest rank); AdamW; "
          f"peer: DDP {args.peer}")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps)]
            mpi = [harness.mpiexec(), "-n", str(args.np)]
            sides = {"raf": mpi + common + ["--side", "raf", "--cache-dir", cache_dir],
                     "ddp": mpi + common + ["--side", "ddp", "--peer", args.peer],
                     "raf 1 process": common + ["--side", "raf", "--cache-dir", cache_dir]}
            if args.pin_ranks:
                sides["raf pinned"] = mpi + common + ["--side", "raf-pinned", "--cache-dir", cache_dir]
            rows.append((name, harness.alternate(sides, args.rounds)))
    print(f"{'model':6s} {'raf_dist ms':>12s} {'DDP ms':>8s} {'ratio [spread]':>16s} "
          f"{'raf 1-proc ms':>14s} {'speedup':>8s}")
    for name, results in rows:
        raf, ddp, solo = ([r["ms"] for r in results[k]] for k in ("raf", "ddp", "raf 1 process"))
        print(f"{name:6s} {statistics.median(raf):12.2f} {statistics.median(ddp):8.2f} "
              f"{harness.format_ratio(raf, ddp):>16s} {statistics.median(solo):14.2f} "
              f"{statistics.median(solo) / statistics.median(raf):8.2f}")
        if "raf pinned" in results:
            pinned = [r["ms"] for r in results["raf pinned"]]
            print(f"{'':6s} raf_dist, ranks on disjoint cores: {statistics.median(pinned):.2f} ms, "
                  f"{harness.format_ratio(pinned, raf)} x unpinned")


if __name__ == "__main__":
    main()

"""Data-parallel step time: raf_dist vs PyTorch DDP (gloo, default 25 MB buckets), same
processes, same global batch, alternating steps.

    mpirun -np 2 python bench/dp_step.py [--model mlp|gpt|all] [--steps 10]

Models are bench/step_time.py's (MLP batch 128, GPT batch 16), AdamW. Each rank takes
global_batch / N rows. Times are the slowest rank's (barrier before each step), median over
steps. Also printed: raf_dist's single-process step on the global batch (rank 0 alone, all
cores) and the speedup / efficiency from 1 to N ranks.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/step_time.py

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402

import raf_dist  # noqa: E402
from raf_dist import distributed as dist  # noqa: E402


def timed(comm, fn):
    comm.mpi_comm.Barrier()
    start = time.perf_counter()
    fn()
    return comm.mpi_comm.allreduce(time.perf_counter() - start, op=__import__("mpi4py").MPI.MAX)


def run(name, steps, cache_dir, comm):
    module, x, y = step_time.make(name)
    n, rank = comm.size, comm.rank
    local = x.shape[0] // n
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    dist.get_config().update({"enable_data_parallel": True})
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    ddp = DistributedDataParallel(module)  # gloo process group, default 25 MB buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    xn, yn = xs.numpy(), ys.numpy()

    def ddp_step():
        step_time.torch_step(ddp, opt, xs, ys)

    for _ in range(3):
        trainer.step(xn, yn)
        ddp_step()
    raf_times, ddp_times = [], []
    for _ in range(steps):
        raf_times.append(timed(comm, lambda: trainer.step(xn, yn)))
        ddp_times.append(timed(comm, ddp_step))

    # one process on the global batch, with the whole machine: the 1-rank baseline
    dist.get_config().enable_data_parallel = False
    single_ms = float("nan")
    if rank == 0:
        torch.set_num_threads(os.cpu_count() or 1)
        solo_module, _, _ = step_time.make(name)
        solo = raf_dist.Trainer(raf_dist.frontend.from_pytorch(solo_module, (x,)),
                                optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
        for _ in range(3):
            solo.step(x.numpy(), y.numpy())
        solo_times = []
        for _ in range(steps):
            start = time.perf_counter()
            solo.step(x.numpy(), y.numpy())
            solo_times.append(time.perf_counter() - start)
        single_ms = statistics.median(solo_times) * 1e3
    comm.idle_barrier()
    return statistics.median(raf_times) * 1e3, statistics.median(ddp_times) * 1e3, single_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    comm = dist.get_communicator()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))
    port = comm.mpi_comm.bcast(29500 + os.getpid() % 1000 if comm.rank == 0 else None, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                             world_size=comm.size)
    names = ["mlp", "gpt"] if args.model == "all" else [args.model]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = comm.mpi_comm.bcast(tmp if comm.rank == 0 else None, root=0)
        for name in names:
            rows.append((name, *run(name, args.steps, cache_dir, comm)))
    if comm.rank == 0:
        n = comm.size
        print(f"# {n} ranks, torch {torch.__version__} DDP/gloo; median of {args.steps} "
              "alternating steps (slowest rank); AdamW")
        print(f"{'model':6s} {'raf_dist ms':>12s} {'DDP ms':>8s} {'ratio':>6s} "
              f"{'raf 1-rank ms':>14s} {'speedup':>8s} {'efficiency':>10s}")
        for name, raf_ms, ddp_ms, single_ms in rows:
            speedup = single_ms / raf_ms
            print(f"{name:6s} {raf_ms:12.2f} {ddp_ms:8.2f} {raf_ms / ddp_ms:6.2f} "
                  f"{single_ms:14.2f} {speedup:8.2f} {speedup / n:10.2f}")
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A DLRM with 2 GiB of embedding tables at N ranks: raf_dist with its tables sharded
(``embedding_parallel``) against PyTorch DDP (gloo) with the tables replicated, each alone
(DESIGN.md section 6), as issue #32 asks.

    python bench/dlrm.py [--np 2] [--mode table|row] [--rows 1000000] [--tables 8]
                         [--steps 6] [--rounds 2] [--only raf] [--optimizer sgd|rowwise_adagrad]

The model (the DLRM benchmark's shape, Naumov et al. 2019): 13 dense features through a
bottom MLP 13-512-256-64; 8 ``nn.EmbeddingBag(rows, 64, mode="sum")`` tables (8 x 1M x 64
float32 = 2 GiB), each looked up with bags of 8 ids per sample (uniform); the pairwise dot
products of the 9 vectors; a top MLP 100-512-256-2; cross-entropy; SGD (lr 0.01, the DLRM
reference's optimizer); a global batch of 512 rows, 512 / N per rank. Both sides start each
rank from the same module built from one seed and time the slowest rank of each step (a
barrier before it) after 2 warm-up steps.

Printed: the median step time and the largest rank's steady RSS (VmRSS after the steps) of
each side, and the ratios raf_dist / PyTorch (median of per-round ratios [spread]): the
targets are a step time <= DDP's and a per-rank memory about half of DDP's.

``--only raf`` runs raf_dist's side alone (tables larger than DDP's replicas fit): the
sparse update's scaling is the step time at ``--rows 1000000`` against ``--rows 4000000``
with the same ids per step. ``--optimizer rowwise_adagrad``: raf_dist's RowWiseAdagrad
(torchrec's; its tables updated on the looked-up rows, one accumulator per row); PyTorch's
side then runs torch.optim.Adagrad (PyTorch has no row-wise one: one accumulator per
element), lr 0.01 both.

    python bench/dlrm.py --side raf|torch ...       one side, one BENCH line (under mpiexec)
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

GLOBAL_BATCH = 512
BAG = 8
DIM = 64


def build(rows, tables=8):
    """(module, (dense, ids), target) for the global batch: ids (batch, tables, bag)."""
    import torch
    from torch import nn

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256),
                                        nn.ReLU(), nn.Linear(256, DIM), nn.ReLU())
            self.tables = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum")
                                        for _ in range(tables))
            features = tables + 1
            pairs = features * (features - 1) // 2
            self.top = nn.Sequential(nn.Linear(DIM + pairs, 512), nn.ReLU(),
                                     nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 2))
            r, c = torch.tril_indices(features, features, offset=-1)
            self.register_buffer("pair_rows", r, persistent=False)
            self.register_buffer("pair_cols", c, persistent=False)

        def forward(self, dense, ids):
            x = self.bottom(dense)
            vectors = torch.stack([x] + [t(ids[:, i]) for i, t in enumerate(self.tables)], 1)
            z = torch.bmm(vectors, vectors.transpose(1, 2))
            return self.top(torch.cat([x, z[:, self.pair_rows, self.pair_cols]], dim=1))

    torch.manual_seed(0)
    module = DLRM()
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(GLOBAL_BATCH, 13, generator=gen)
    ids = torch.randint(0, rows, (GLOBAL_BATCH, tables, BAG), generator=gen)
    return module, (dense, ids), torch.randint(0, 2, (GLOBAL_BATCH,), generator=gen)


def _status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _slowest(fn):
    """The step's time on the slowest rank (every rank starts it together)."""
    from mpi4py import MPI

    world = _world()
    world.Barrier()
    start = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def _local(arrays, rank, size):
    rows = GLOBAL_BATCH // size
    return [a[rank * rows:(rank + 1) * rows] for a in arrays]


def raf_side(mode, rows, tables, steps, cache_dir, optimizer="sgd"):
    import raf_dist
    from raf_dist import distributed as dist

    comm = dist.get_communicator()
    module, x, y = build(rows, tables)
    dist.get_config().update({"enable_data_parallel": True, "embedding_parallel": mode})
    xs = _local(list(x) + [y], comm.rank, comm.size)
    model = raf_dist.frontend.from_pytorch(module, tuple(xs[:-1]))
    del module  # raf_dist keeps no reference to it
    opt = (raf_dist.optim.SGD(lr=0.01) if optimizer == "sgd"
           else raf_dist.optim.RowWiseAdagrad(lr=0.01))
    trainer = raf_dist.Trainer(model, optimizer=opt, cache_dir=cache_dir)
    del model
    arrays = [a.numpy() for a in xs[:-1]]
    target = xs[-1].numpy()
    ms = harness.median_ms(lambda: trainer.step(arrays, target), steps, warmup=2,
                           timer=_slowest)
    gc.collect()
    stats = trainer.stats()
    from mpi4py import MPI

    return {"step_ms": ms, "rss": _world().allreduce(_status("VmRSS"), op=MPI.MAX),
            "param_bytes": _world().allreduce(stats["param_bytes"], op=MPI.MAX),
            "state_bytes": _world().allreduce(stats["optimizer_state_bytes"], op=MPI.MAX),
            "alltoall_bytes": stats["comm_bytes_last_step"].get("alltoall", 0)}


def torch_side(rows, tables, steps, optimizer="sgd"):
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    world = _world()
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local.size))
    port = world.bcast(29500 + os.getpid() % 1000 if world.rank == 0 else None, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                             rank=world.rank, world_size=world.size)
    module, x, y = build(rows, tables)
    dense, ids, target = _local(list(x) + [y], world.rank, world.size)
    module = DistributedDataParallel(module)
    opt = (torch.optim.SGD(module.parameters(), lr=0.01) if optimizer == "sgd"
           else torch.optim.Adagrad(module.parameters(), lr=0.01))

    def step():
        opt.zero_grad()
        F.cross_entropy(module(dense, ids), target).backward()
        opt.step()

    ms = harness.median_ms(step, steps, warmup=2, timer=_slowest)
    gc.collect()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"step_ms": ms, "rss": world.allreduce(_status("VmRSS"), op=MPI.MAX),
            "param_bytes": params}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--mode", default="table", choices=["table", "row"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", choices=["raf"], help="raf_dist's side alone")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "rowwise_adagrad"])
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = (raf_side(args.mode, args.rows, args.tables, args.steps, args.cache_dir,
                           args.optimizer) if args.side == "raf"
                  else torch_side(args.rows, args.tables, args.steps, args.optimizer))
        if _world().rank == 0:
            harness.report(result)
        return
    print(f"# {harness.machine()}")
    base = [harness.mpiexec(), "-n", str(args.np), sys.executable, __file__, "--rows",
            str(args.rows), "--tables", str(args.tables), "--steps", str(args.steps),
            "--mode", args.mode, "--optimizer", args.optimizer]
    with tempfile.TemporaryDirectory() as cache:  # round 1 compiles, later rounds load
        sides = {"raf": base + ["--side", "raf", "--cache-dir", cache]}
        if args.only is None:
            sides["torch"] = base + ["--side", "torch"]
        results = harness.alternate(sides, args.rounds)
    raf = results["raf"]

    def med(rows, key, scale=1.0):
        return statistics.median(r[key] for r in rows) / scale

    gib = 2**30
    tables = args.tables * args.rows * DIM * 4 / gib
    print(f"DLRM {args.tables} x {args.rows} x {DIM} ({tables:.2f} GiB of tables), batch "
          f"{GLOBAL_BATCH} over {args.np} ranks, {args.mode}-wise"
          f"{'' if args.only else ' vs DDP (replicated)'}:")
    if args.only:
        print(f"  step ({args.optimizer}): raf_dist {med(raf, 'step_ms'):.0f} ms; RSS per rank "
              f"(largest) {med(raf, 'rss', gib):.2f} GiB; parameters held per rank "
              f"{med(raf, 'param_bytes', gib):.2f} GiB, optimizer state "
              f"{med(raf, 'state_bytes', 2**20):.1f} MiB")
        return
    peer = results["torch"]
    print(f"  step: raf_dist {med(raf, 'step_ms'):.0f} ms, PyTorch DDP {med(peer, 'step_ms'):.0f}"
          f" ms, ratio {harness.format_ratio([r['step_ms'] for r in raf], [r['step_ms'] for r in peer])}")
    print(f"  RSS per rank (largest): raf_dist {med(raf, 'rss', gib):.2f} GiB, PyTorch DDP "
          f"{med(peer, 'rss', gib):.2f} GiB, ratio "
          f"{harness.format_ratio([r['rss'] for r in raf], [r['rss'] for r in peer])}")
    print(f"  parameters held per rank: raf_dist {med(raf, 'param_bytes', gib):.2f} GiB, "
          f"PyTorch {med(peer, 'param_bytes', gib):.2f} GiB; raf_dist all-to-all "
          f"{med(raf, 'alltoall_bytes', 2**20):.1f} MiB a step on rank 0")


if __name__ == "__main__":
    main()

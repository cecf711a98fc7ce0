"""Steady-state resident memory of training: raf_dist vs PyTorch eager, each alone (DESIGN.md
section 6), and how much of raf_dist's Trainer.stats() accounts for.

    python bench/memory.py [--model gemm_gpt|gpt2_124m|all] [--steps 3] [--rounds 2]

Models (AdamW, float32, single process): ``gemm_gpt`` (bench/mixed_precision.py's 23M GPT:
6 layers, d=512, seq 128, vocab 4096, batch 8) and ``gpt2_124m`` (transformers
GPT2LMHeadModel, default configuration, dropout off, batch 4 x 128). Each side builds the
model, trains ``--steps`` steps and reports its RSS (VmRSS) and peak RSS (VmHWM); raf_dist's
side lets the torch module go after capturing it (nothing of raf_dist needs it) and also
reports stats()["total_bytes"] beside the RSS growth since ``import raf_dist`` (what the total
predicts) and since just before the capture. Printed per
model: each side's median RSS and peak over the rounds and the ratio raf_dist / PyTorch
(median of the per-round ratios [spread]; issue #31's target <= 1.1).

    python bench/memory.py --np 2 [--zero 3] [--model gemm_gpt]

runs each side as an `mpiexec -n N` job instead: raf_dist data parallel (ZeRO level
``--zero``) against PyTorch DDP (gloo), each rank on global batch / N rows; the RSS printed is
the largest rank's.

    python bench/memory.py --side raf|torch --model gemm_gpt     one side, one BENCH line
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # tests/hf.py
import harness  # noqa: E402

MODELS = ["gemm_gpt", "gpt2_124m"]


def _status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def make(name):
    import torch

    if name == "gemm_gpt":
        from mixed_precision import make as make_gpt

        module, x, y = make_gpt("gemm_gpt")
        return module, x, y
    from hf import LogitsOnly, import_transformers

    transformers = import_transformers()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    module = LogitsOnly(transformers.GPT2LMHeadModel(config))
    return (module, torch.randint(0, config.vocab_size, (4, 128), generator=gen),
            torch.randint(0, config.vocab_size, (4, 128), generator=gen))


def _local(x, y, rank, size):
    rows = len(x) // size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _largest_rank(result):
    """``result`` with each value the largest over the ranks of an MPI job (itself alone)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return {k: world.allreduce(v, op=MPI.MAX) for k, v in result.items()}


def raf_side(name, steps, cache_dir, zero=0):
    import raf_dist
    from raf_dist import distributed as dist
    from raf_dist import process_memory

    comm = dist.get_communicator()
    module, x, y = make(name)
    if comm.size > 1:
        dist.get_config().enable_data_parallel = True
        dist.get_config().zero_opt_level = zero
        x, y = _local(x, y, comm.rank, comm.size)
    before = process_memory.rss_bytes()
    model = raf_dist.frontend.from_pytorch(module, (x,))
    del module  # the user's choice: raf_dist keeps no reference to it
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(lr=1e-4),
                               cache_dir=cache_dir)
    del model
    construction_peak = _status("VmHWM")
    xn, yn = x.numpy(), y.numpy()
    for _ in range(steps):
        trainer.step(xn, yn)
    gc.collect()
    stats = trainer.stats()
    return _largest_rank({"rss": _status("VmRSS"), "peak": _status("VmHWM"),
                          "construction_peak": construction_peak,
                          "growth": _status("VmRSS") - before,
                          # stats()'s total predicts this one (process_memory.baseline_rss)
                          "growth_since_import": _status("VmRSS") - process_memory.baseline_rss(),
                          "total_bytes": stats["total_bytes"],
                          "library_bytes": stats["library_bytes"]})


def torch_side(name, steps):
    import os

    import torch
    import torch.nn.functional as F

    module, x, y = make(name)
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if size > 1:  # DDP over gloo, as bench/dp_step.py runs it
        import torch.distributed as tdist
        from mpi4py import MPI
        from torch.nn.parallel import DistributedDataParallel

        world = MPI.COMM_WORLD
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local.size))
        port = world.bcast(29500 + os.getpid() % 1000 if world.rank == 0 else None, root=0)
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                 rank=world.rank, world_size=world.size)
        x, y = _local(x, y, world.rank, world.size)
        module = DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        out = module(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    gc.collect()
    result = {"rss": _status("VmRSS"), "peak": _status("VmHWM")}
    return _largest_rank(result) if size > 1 else result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=[*MODELS, "all"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--np", type=int, default=1, help="ranks (data parallel vs DDP)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = (raf_side(args.model, args.steps, args.cache_dir, args.zero)
                  if args.side == "raf" else torch_side(args.model, args.steps))
        if int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
            harness.report(result)
        return
    print(f"# {harness.machine()}")
    mib = 2**20
    with tempfile.TemporaryDirectory() as cache:  # round 1 compiles, later rounds load
        for name in MODELS if args.model == "all" else [args.model]:
            base = ([harness.mpiexec(), "-n", str(args.np)] if args.np > 1 else []) + [
                sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                "--zero", str(args.zero)]
            results = harness.alternate(
                {"raf": base + ["--side", "raf", "--cache-dir", cache],
                 "torch": base + ["--side", "torch"]}, args.rounds)
            raf, peer = results["raf"], results["torch"]

            def med(rows, key):
                return statistics.median(r[key] for r in rows) / mib

            where = f" x {args.np} ranks (ZeRO-{args.zero} vs DDP, largest rank)" if args.np > 1 else ""
            print(f"{name}{where}: RSS raf_dist {med(raf, 'rss'):.0f} MiB, PyTorch "
                  f"{med(peer, 'rss'):.0f} MiB, ratio "
                  f"{harness.format_ratio([r['rss'] for r in raf], [r['rss'] for r in peer])}"
                  f"; peak {med(raf, 'peak'):.0f} vs {med(peer, 'peak'):.0f} MiB, ratio "
                  f"{harness.format_ratio([r['peak'] for r in raf], [r['peak'] for r in peer])}")
            print(f"  raf_dist: construction peak {med(raf, 'construction_peak'):.0f} MiB "
                  f"(steady {med(raf, 'rss'):.0f}); RSS growth since capture "
                  f"{med(raf, 'growth'):.0f} MiB; since import raf_dist "
                  f"{med(raf, 'growth_since_import'):.0f} MiB against stats()'s total "
                  f"{med(raf, 'total_bytes'):.0f} MiB (libraries "
                  f"{med(raf, 'library_bytes'):.0f}; the first is net of the torch module the "
                  "side lets go after the capture)")


if __name__ == "__main__":
    main()

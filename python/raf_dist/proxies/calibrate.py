"""``mpirun -np 2 python -m raf_dist.proxies calibrate [--calibration-out FILE]``: measure
this machine for the ``cpu-here`` cluster (proxies/simulate.py) and save it
(~/.cache/raf_dist/cpu-here.json, which ``--cluster cpu-here`` then reads, or FILE, a cluster
JSON for ``--cluster FILE``). With N ranks on fewer cores it measures N ranks sharing them,
each with the compute threads a Trainer would give it (cores / ranks on the host):
float32 GEMM rate (numpy's BLAS, 1024^3, best of 5), copy bandwidth (64 MiB, best of 5),
raf_dist's allreduce between the ranks: alpha from 4 KiB calls, bus bandwidth from 64 MiB
ones (medians of 20 and 5, between barriers), and the host time per operator call: every
rank trains its own copy of a model whose tensors are tiny (no communication; the compute
is negligible, so a step is its calls: the VM's dispatch, the kernels' entry, the Trainer's
Python), and the median step divided by the step's operator count as the extraction counts
them (proxies/extract.py) is what the cost model charges per call."""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
from tvm.relax.frontend import nn

from .simulate import _CALIBRATED, Cluster, Link


def _best(fn, repeats):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


class _TinyMLP(nn.Module):
    """The calibration's model: a layer norm and 8 linear + GELU layers of width 16, so a
    step is its operator calls (raf_dist.nn: calibrate needs no torch)."""

    def __init__(self) -> None:
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(8)])
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = nn.op.gelu(layer(x))
        return self.head(x)


def _op_overhead_us(comm) -> float:
    """Microseconds of host time per operator call with every rank stepping at once (module
    docstring): the median over the ranks of each one's median step / its operator count."""
    import raf_dist

    from .extract import MeshSpec, extract

    model = raf_dist.frontend.from_relax_nn(_TinyMLP(), [((4, 16), "float32")])
    ops = sum(e.ops for e in extract(model, MeshSpec()).programs[0])
    # this rank alone (no data parallelism whatever the config says): no communication
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(lr=1e-3), local=True)
    rng = np.random.default_rng(comm.rank)
    xs = rng.standard_normal((4, 16), np.float32)
    ys = rng.integers(0, 8, (4,))
    for _ in range(5):
        trainer.step(xs, ys)
    comm.Barrier()
    times = []
    for _ in range(30):
        began = time.perf_counter()
        trainer.step(xs, ys)
        times.append(time.perf_counter() - began)
    return statistics.median(comm.allgather(statistics.median(times) / ops * 1e6))


def calibrate(out_path: str = _CALIBRATED) -> int:
    from mpi4py import MPI

    from ..distributed import collectives, get_communicator
    from ..runtime.threads import set_num_threads, threads_per_rank

    comm = MPI.COMM_WORLD
    n = comm.size
    # each rank's compute threads as a Trainer sizes them (cores / ranks on this host): the
    # rates measured are the ones a step of N ranks gets, not N oversubscribed BLAS pools
    set_num_threads(threads_per_rank(get_communicator().local_size))
    a = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)
    gemm = 2 * 1024 ** 3 / _best(lambda: a @ a, 5)
    src = np.ones(16 * 2**20, np.float32)
    dst = np.empty_like(src)
    copy = 2 * src.nbytes / _best(lambda: np.copyto(dst, src), 5)  # read + write

    def allreduce_median(elements, repeats):
        x = np.ones(elements, np.float32)
        times = []
        for _ in range(repeats):
            comm.Barrier()
            began = time.perf_counter()
            collectives.allreduce(x, "sum", x)
            times.append(comm.allreduce(time.perf_counter() - began, op=MPI.MAX))
        return statistics.median(times)

    op_us = _op_overhead_us(comm)
    if n > 1:
        small = allreduce_median(1024, 20)
        big_elements = 16 * 2**20
        big = allreduce_median(big_elements, 5)
        alpha = small / (2 * (n - 1))
        bus = 2 * (n - 1) / n * big_elements * 4 / max(big - 2 * (n - 1) * alpha, 1e-9)
        link = Link(round(alpha * 1e6, 2), round(bus / 1e9, 3))
    else:  # one process: its compute rates only (no link to measure)
        link = Link(0.0, 1e6)
    cluster = Cluster("cpu-here", n, round(gemm / 1e12, 4), round(copy / 1e9, 2), link, link,
                      round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                      f"measured {time.strftime('%Y-%m-%d')} with {n} ranks on this host",
                      op_overhead_us=round(op_us, 2))
    if comm.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(cluster.to_dict(), f, indent=1)
        print(json.dumps(cluster.to_dict()))
        print(f"saved to {out_path}")
    return 0

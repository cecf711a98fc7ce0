"""Bad input that only shows across ranks: every rank builds a data-parallel Trainer, but one
rank's model, config or optimizer differs from the others'. The Trainer's cross-rank
fingerprint check (Trainer._check_fingerprints) must refuse it on every rank, naming what
differs, before the step's first collective (tests/unit/test_bad_input_matrix.py).

Usage: bad_input_worker.py CASE [CASE ...], CASE one of config_mismatch, model_mismatch,
optimizer_mismatch. The cases run one after the other in one launch (each is refused on
every rank together, so the ranks stay in step). For each case every rank prints one line

    BAD_INPUT rank R case CASE: <ExceptionType>: <message, on one line>

or ``BAD_INPUT rank R case CASE: NO ERROR`` when the Trainer accepted it. Exits 0.
"""
import sys
from pathlib import Path

import torch

import raf_dist
from raf_dist import distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/models.py
from models import MLP  # noqa: E402

CASES = ("config_mismatch", "model_mismatch", "optimizer_mismatch")


def _capture(sizes):
    torch.manual_seed(0)
    return raf_dist.frontend.from_pytorch(MLP(sizes), (torch.randn(4, 20),))


def main():
    cases = sys.argv[1:]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise SystemExit(f"usage: bad_input_worker.py CASE [CASE ...] with CASE in {CASES}, "
                         f"got {sys.argv[1:]}")
    comm = dist.get_communicator()
    config = dist.get_config()
    odd = comm.rank == comm.size - 1  # the one rank that differs
    models = {}

    def model(sizes):
        if sizes not in models:
            models[sizes] = _capture(sizes)
        return models[sizes]

    for case in cases:
        config.reset()
        config.enable_data_parallel = True
        sizes, lr = (20, 32, 32, 5), 0.1
        if case == "config_mismatch" and odd:
            config.bucket_size_mb = 1  # 25 on the other ranks
        elif case == "model_mismatch" and odd:
            sizes = (20, 16, 32, 5)  # a narrower first layer
        elif case == "optimizer_mismatch" and odd:
            lr = 0.01
        try:
            raf_dist.Trainer(model(sizes), optimizer=raf_dist.optim.SGD(lr=lr))
        except Exception as exc:  # noqa: BLE001 - reported, whatever it is
            message = str(exc).replace("\n", " ")
            print(f"BAD_INPUT rank {comm.rank} case {case}: {type(exc).__name__}: {message}",
                  flush=True)
        else:
            print(f"BAD_INPUT rank {comm.rank} case {case}: NO ERROR", flush=True)
    config.reset()


if __name__ == "__main__":
    main()

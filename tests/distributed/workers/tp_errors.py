"""Bad tensor-parallel layouts fail on every rank, at Trainer construction, before any
collective: a world that does not split into dp x tp, dp > 1 without data parallelism.

Usage: tp_errors.py world|no_dp. Each rank prints 'rank R: refused: <message>' and exits 0."""
import sys

import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import MLP  # noqa: E402


def main():
    case = sys.argv[1]
    comm = dist.get_communicator()
    config = dist.get_config()
    if case == "world":  # 3 ranks, tp 2
        config.update({"tensor_parallel_size": 2, "enable_data_parallel": True})
    elif case == "no_dp":  # 4 ranks, tp 2: dp 2 without data parallelism
        config.update({"tensor_parallel_size": 2})
    module = MLP((20, 30, 32, 5))
    model = raf_dist.frontend.from_pytorch(module, (torch.randn(4, 20),))
    try:
        raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))
    except ValueError as exc:
        print(f"rank {comm.rank}: refused: {exc}".replace("\n", " "))
        return
    raise SystemExit(f"rank {comm.rank}: the Trainer accepted case {case}")


if __name__ == "__main__":
    main()

"""Ranks that build different Trainers: the agreement at Trainer construction (before any
other collective) ends every rank with the difference named, instead of a hang or unrelated
failures in the collectives that follow.

Usage: agree_worker.py CASE
  loss            rank 1 uses mse, rank 0 cross_entropy          -> ValueError naming loss
  zero            rank 1 sets zero_opt_level 1, rank 0 0         -> ValueError naming config
  device          rank 1 asks for "cuda", rank 0 for "cpu"         -> ValueError naming device
                  (before the device check, whose collectives would run on some ranks only)
  data_parallel   rank 1 builds its Trainer without data parallelism (a local Trainer): rank
                  0 waits at the agreement barrier, whose timeout (RAF_DIST_BARRIER_TIMEOUT_S)
                  names rank 1
Each rank prints 'rank R: refused: <message>' for the ValueErrors."""
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
    config.enable_data_parallel = True
    loss = "cross_entropy"
    if case == "loss" and comm.rank == 1:
        loss = "mse"
    if case == "zero":
        config.zero_opt_level = comm.rank
    if case == "data_parallel" and comm.rank == 1:
        config.enable_data_parallel = False
    device = "cuda" if case == "device" and comm.rank == 1 else "cpu"
    model = raf_dist.frontend.from_pytorch(MLP(), (torch.randn(4, 20),))
    try:
        trainer = raf_dist.Trainer(model, loss=loss, optimizer=raf_dist.optim.SGD(lr=0.1),
                                   device=device)
    except ValueError as exc:
        print(f"rank {comm.rank}: refused: {exc}".replace("\n", " "), flush=True)
        return
    print(f"rank {comm.rank}: built a Trainer (spmd={trainer.spmd})", flush=True)


if __name__ == "__main__":
    main()

"""Ranks that build different Trainers: the agreement at Trainer construction (before any
other collective) ends every rank with the difference named, instead of a hang or unrelated
failures in the collectives that follow.

Usage: agree_worker.py CASE
  loss            rank 1 uses mse, rank 0 cross_entropy          -> ValueError naming loss
  zero            rank 1 sets zero_opt_level 1, rank 0 0         -> ValueError naming config
  device          rank 1 asks for "cuda", rank 0 for "cpu"         -> ValueError naming device
                  (before the device check, whose collectives would run on some ranks only)
  data_parallel   only rank 0 sets enable_data_parallel           -> ValueError naming
                  enable_data_parallel on both ranks (rank 1 would otherwise train alone
                  and leave rank 0 waiting in its first collective)
  independent     no rank asks for parallelism                    -> both build local
                  Trainers (spmd=False) and train different models, each on its own
  one_rank        rank 0 builds a Trainer, rank 1 none: rank 0 waits at the agreement
                  barrier, whose timeout (RAF_DIST_BARRIER_TIMEOUT_S) names rank 1
  one_rank_local  rank 0 builds Trainer(local=True), rank 1 none    -> rank 0 trains alone
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
    if case in ("independent", "one_rank", "one_rank_local"):
        config.enable_data_parallel = False
        if case.startswith("one_rank") and comm.rank == 1:
            return
    device = "cuda" if case == "device" and comm.rank == 1 else "cpu"
    # "independent": a model of another size on each rank (nothing is compared)
    x = torch.randn(4 + comm.rank, 20)
    model = raf_dist.frontend.from_pytorch(MLP(), (x,))
    try:
        trainer = raf_dist.Trainer(model, loss=loss, optimizer=raf_dist.optim.SGD(lr=0.1),
                                   device=device, local=case == "one_rank_local")
    except ValueError as exc:
        print(f"rank {comm.rank}: refused: {exc}".replace("\n", " "), flush=True)
        return
    loss = trainer.step(x.numpy(), torch.randint(0, 5, (len(x),)).numpy())
    print(f"rank {comm.rank}: built a Trainer (spmd={trainer.parallel.spmd}) loss {loss:.3f}", flush=True)


if __name__ == "__main__":
    main()

"""Batch norm under data parallelism on N ranks, against PyTorch.

Usage: bn_train.py MODEL [STEPS]
  sync_batch_norm=True: N ranks must equal one PyTorch process on the global batch (losses,
  parameters, running statistics), as torch.nn.SyncBatchNorm does.
  default: as DDP with broadcast_buffers=True: each rank normalizes with its own batch's
  statistics, gradients are averaged, and the running statistics kept are rank 0's (updated
  from rank 0's local batch), the same on every rank.
Norm-relative tolerance 2e-5 (float32 reduction order; see tests/numeric/test_buffers.py).
Prints 'rank R: ALL OK' when both passed."""
import copy
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, torch_loss, torch_optimizer  # noqa: E402

GLOBAL_BATCH = 12
TOL = 2e-5
OPT = "sgd_momentum"


def reference(name, steps, n, sync):
    """PyTorch: global batch (sync) or DDP's semantics simulated rank by rank (default)."""
    module, x, y = make(name, GLOBAL_BATCH)
    module.train()
    opt = torch_optimizer(OPT, module.parameters())
    local = GLOBAL_BATCH // n
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if sync:
            loss = torch_loss(module(x), y)
        else:
            start = copy.deepcopy(dict(module.named_buffers()))
            rank_losses, kept = [], None
            for r in range(n):
                for b_name, b in module.named_buffers():  # DDP: rank 0's buffers before forward
                    b.data.copy_(start[b_name])
                rows = slice(r * local, (r + 1) * local)
                rank_losses.append(torch_loss(module(x[rows]), y[rows]))
                if r == 0:
                    kept = {b_name: b.detach().clone() for b_name, b in module.named_buffers()}
            for b_name, b in module.named_buffers():
                b.data.copy_(kept[b_name])
            loss = sum(rank_losses) / n
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, module


def check(name, steps, sync):
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    module, x, y = make(name, GLOBAL_BATCH)
    local = GLOBAL_BATCH // n
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    config = dist.get_config()
    config.update({"enable_data_parallel": True, "sync_batch_norm": sync})
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                               optimizer=raf_optimizer(OPT))
    losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
    ref_losses, ref = reference(name, steps, n, sync)
    what = f"{name} sync_batch_norm={sync}"
    assert rel_err(losses, ref_losses) <= TOL, (what, losses, ref_losses)
    params, buffers = trainer.state_dict(), trainer.buffers_dict()
    for p_name, p in ref.named_parameters():
        assert rel_err(params[p_name], p.detach().numpy()) <= TOL, (what, p_name)
    for b_name, b in ref.named_buffers():
        if b.dtype == torch.int64:
            assert np.array_equal(buffers[b_name], b.numpy()), (what, b_name)
        else:
            assert rel_err(buffers[b_name], b.numpy()) <= TOL, (what, b_name)
    # every rank holds the same (rank 0's) running statistics
    everyone = comm.mpi_comm.allgather({k: v.tobytes() for k, v in buffers.items()})
    assert all(e == everyone[0] for e in everyone), what
    config.reset()


def main():
    name = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    check(name, steps, sync=True)
    check(name, steps, sync=False)
    print(f"rank {dist.get_communicator().rank}: ALL OK")


if __name__ == "__main__":
    main()

"""Uneven global batches on N ranks vs one process (PyTorch) on the same global batches.

Usage: uneven_batch.py LEVEL[,LEVEL...]  (0: plain data parallelism; 1-3: ZeRO)
15 rows in global batches of 8 with data.shard(drop_last=False): 8 rows (4 + 4 on 2 ranks),
then the 7-row tail (4 + 3), for 2 epochs. Each rank's Trainer (captured with 4 rows) must
return the mean loss over each global batch and end with PyTorch's parameters (one process,
AdamW, the same global batches). Also: a rank with no rows makes every rank raise the same
error. Prints 'rank R: ALL OK' when every level passed."""
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, torch_optimizer  # noqa: E402

ROWS, GLOBAL_BATCH, EPOCHS = 15, 8, 2
# float32 reductions in another order per rank count and step: ~1e-7 each; 4 steps << 2e-5
TOL = 2e-5


def reference():
    """PyTorch on the whole global batches, in data.shard's order (losses, parameters)."""
    module, x, y = make("mlp", ROWS, seed=0)
    opt = torch_optimizer("adamw", module.parameters())
    losses = []
    for _ in range(EPOCHS):
        for begin in range(0, ROWS, GLOBAL_BATCH):
            xb, yb = x[begin:begin + GLOBAL_BATCH], y[begin:begin + GLOBAL_BATCH]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(module(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in module.named_parameters()}


def check(level, ref_losses, ref_params):
    comm = dist.get_communicator()
    module, x, y = make("mlp", ROWS, seed=0)
    local = GLOBAL_BATCH // comm.size
    config = dist.get_config()
    config.update({"enable_data_parallel": True, "zero_opt_level": level,
                   "bucket_size_mb": 0.001})  # several buckets
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[:local],)),
                               optimizer=raf_optimizer("adamw"))
    losses, sizes = [], []
    for _ in range(EPOCHS):
        for xb, yb in raf_dist.data.shard((x.numpy(), y.numpy()), GLOBAL_BATCH, drop_last=False):
            sizes.append(len(xb))
            losses.append(trainer.step(xb, yb))
    expected_sizes = [4, 4 if comm.rank == 0 else 3] * EPOCHS if comm.size == 2 else sizes
    assert sizes == expected_sizes, sizes
    assert rel_err(losses, ref_losses) <= TOL, (level, losses, ref_losses)
    params = trainer.state_dict()
    for name, value in ref_params.items():
        assert rel_err(params[name], value) <= TOL, (level, name, rel_err(params[name], value))
    if level == 0:  # a rank without rows: every rank raises, none waits
        rows = 0 if comm.rank == comm.size - 1 else local
        try:
            trainer.step(x.numpy()[:rows], y.numpy()[:rows])
        except ValueError as err:
            assert "got no rows" in str(err), err
        else:
            raise AssertionError("a step with an empty rank did not raise")
    config.reset()
    return trainer.compiled_batch_sizes


def main():
    ref_losses, ref_params = reference()
    for level in map(int, sys.argv[1].split(",")):
        sizes = check(level, ref_losses, ref_params)
        print(f"rank {dist.get_communicator().rank}: level {level} OK, steps compiled for "
              f"{sizes} rows")
    print(f"rank {dist.get_communicator().rank}: ALL OK")


if __name__ == "__main__":
    main()

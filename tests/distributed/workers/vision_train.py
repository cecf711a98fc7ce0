"""torchvision's ResNet (BasicBlock, BatchNorm) on N ranks against one PyTorch process on the
global batch. Usage: vision_train.py MODE DIR

  train   (2 ranks) data parallelism with sync_batch_norm, then ZeRO-3 with sync_batch_norm:
          3 steps each must equal PyTorch on the global batch (losses, parameters, running
          statistics); the ZeRO-3 run then saves a checkpoint to DIR
  load    (any N dividing the global batch) data parallelism (ZeRO-2) with sync_batch_norm
          loads DIR and trains 3 more steps: equal to 6 uninterrupted steps of one process
SGD with momentum (its state is resharded too): AdamW would turn the rounding differences of
near-zero gradient elements into steps of about lr (tests/numeric/test_vision_models.py), and
this check is about the distribution, not about Adam. Norm-relative tolerance 2e-5 (float32
reduction order; see tests/numeric/test_buffers.py). Prints 'rank R: ALL OK'."""
import sys
from pathlib import Path

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import raf_optimizer, rel_err, torch_optimizer, torch_step  # noqa: E402
from vision import make_vision  # noqa: E402

GLOBAL_BATCH = 12  # divides by 2 and 3 ranks
TOL = 2e-5
STEPS = 3
OPT = "sgd_momentum"


def reference(steps):
    """PyTorch alone on the global batch: losses and the module after ``steps`` AdamW steps."""
    module, x, y = make_vision("resnet", GLOBAL_BATCH)
    module.train()
    opt = torch_optimizer(OPT, module.parameters())
    return [torch_step(module, opt, x, y) for _ in range(steps)], module


def trainer(level):
    """This rank's Trainer (data parallel, ZeRO ``level``, synchronized batch norm) and its
    slice of the global batch."""
    comm = dist.get_communicator()
    local = GLOBAL_BATCH // comm.size
    module, x, y = make_vision("resnet", GLOBAL_BATCH)
    rows = slice(comm.rank * local, (comm.rank + 1) * local)
    dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                              "sync_batch_norm": True, "bucket_size_mb": 1.0})
    model = raf_dist.frontend.from_pytorch(module, (x[rows],))
    return (raf_dist.Trainer(model, optimizer=raf_optimizer(OPT)), x[rows].numpy(),
            y[rows].numpy())


def check(what, t, losses, ref_losses, ref):
    params, buffers = t.state_dict(), t.buffers_dict()
    worst = max([rel_err(params[n], p.detach().numpy()) for n, p in ref.named_parameters()]
                + [rel_err(buffers[n], b.numpy()) for n, b in ref.named_buffers()])
    if dist.get_communicator().rank == 0:
        print(f"{what}: losses {rel_err(losses, ref_losses):.2e} apart, parameters and "
              f"buffers at most {worst:.2e}")
    assert rel_err(losses, ref_losses) <= TOL, (what, losses, ref_losses)
    for name, p in ref.named_parameters():
        err = rel_err(params[name], p.detach().numpy())
        assert err <= TOL, (what, name, err)
    for name, b in ref.named_buffers():
        if b.dtype == torch.int64:  # num_batches_tracked
            assert np.array_equal(buffers[name], b.numpy()), (what, name)
        else:
            err = rel_err(buffers[name], b.numpy())
            assert err <= TOL, (what, name, err)


def main():
    mode, directory = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)  # the ranks share the machine's cores
    comm = dist.get_communicator()
    if mode == "train":
        ref_losses, ref = reference(STEPS)
        for level in (0, 3):
            t, xs, ys = trainer(level)
            losses = [t.step(xs, ys) for _ in range(STEPS)]
            check(f"sync batch norm, ZeRO level {level}", t, losses, ref_losses, ref)
        t.save_checkpoint(directory)  # the ZeRO-3 run's: sharded over 2 ranks
    elif mode == "load":
        ref_losses, ref = reference(2 * STEPS)
        t, xs, ys = trainer(2)
        t.load_checkpoint(directory)
        assert t.step_count == STEPS, t.step_count
        losses = [t.step(xs, ys) for _ in range(STEPS)]
        check(f"resumed on {comm.size} ranks", t, losses, ref_losses[STEPS:], ref)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.get_config().reset()
    print(f"rank {comm.rank}: ALL OK")


if __name__ == "__main__":
    main()

"""Data-parallel training of a small CNN on scikit-learn's bundled digits (no download).

    mpirun -np 2 python scripts/distributed/dist_example.py
    mpirun -np 4 --hostfile scripts/distributed/hostfile.localhost python scripts/distributed/dist_example.py
    mpirun -np 2 python scripts/distributed/dist_example.py --zero-level 3 --checkpoint ckpt/
    mpirun -np 2 python scripts/distributed/dist_example.py --device cuda   (one rank per GPU)
    mpirun -np 4 python scripts/distributed/dist_example.py --tp 2   (dp 2 x tp 2)
    mpirun -np 4 python scripts/distributed/dist_example.py --pp 2 --microbatches 4   (dp 2 x pp 2)

As in RAF's distributed example, the distribution switches sit in ``raf_dist_config`` below
and are applied to ``dist.get_config()`` before the Trainer is built. Every rank takes its
slice of each global batch; the loss printed is the mean over the global batch; held-out
accuracy is computed on each rank's share of the test set and summed across ranks.
With ``--checkpoint DIR`` a sharded checkpoint is saved after every epoch and a later run
(any number of ranks, any ZeRO level) resumes from it.
With ``--tp N`` the world is dp x tp (``tensor_parallel_size = N``, dp = world / N): the ranks
of one tp group take the same slice of each global batch (that of their ``mesh.dp_rank``) and
rank 0 prints the tensor-parallel plan (also without MPI: ``python -m
raf_dist.tools.explain_plan --tp 2 scripts/distributed/dist_example.py:digits_cnn``). Here
the classifier splits along its classes (vocabulary-parallel cross-entropy) and the
convolutions stay replicated.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import raf_dist
from raf_dist import distributed as dist

raf_dist_config = {
    "enable_data_parallel": True,  # average gradients across ranks
    "zero_opt_level": 0,  # 0: plain data parallelism (ZeRO levels: see the README)
    "bucket_size_mb": 25.0,  # gradient bucket size for the allreduce
    "overlap_comm": True,  # start each bucket's allreduce while backward continues
}


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def digits_cnn(batch=4):
    """The example's model and an example input (``raf_dist.tools.explain_plan``'s factory
    form): ``python -m raf_dist.tools.explain_plan --tp 2
    scripts/distributed/dist_example.py:digits_cnn``."""
    return DigitsCNN(), torch.zeros(batch, 1, 8, 8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--zero-level", type=int, choices=[0, 1, 2, 3],
                        help="override raf_dist_config['zero_opt_level']")
    parser.add_argument("--checkpoint", help="save after each epoch here; resume if present")
    parser.add_argument("--device", default="cpu",
                        help='"cpu", or "cuda" for the GPU of each rank\'s local rank (one rank '
                             'per GPU; NCCL collectives)')
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size: the world becomes dp x tp, dp = ranks / tp")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline_parallel_size: stages on P ranks (world = pp x dp x tp)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="num_microbatches per step (pipelining, gradient accumulation)")
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved_1f1b"],
                        help="pipeline_schedule (with --pp)")
    args = parser.parse_args()

    dist.get_config().update(raf_dist_config)
    if args.zero_level is not None:
        dist.get_config().zero_opt_level = args.zero_level
    dist.get_config().update({"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
                              "num_microbatches": args.microbatches,
                              "pipeline_schedule": args.schedule})
    comm = dist.get_communicator()
    # this rank's data-parallel index: ranks of one tp or pp group feed the same rows
    mesh = dist.get_mesh() if args.tp > 1 or args.pp > 1 else None
    dp_rank, dp_size = (mesh.dp_rank, mesh.dp_size) if mesh else (comm.rank, comm.size)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int64), test_size=0.2, random_state=0)
    local_batch = args.global_batch // dp_size
    if args.global_batch % dp_size:
        sys.exit(f"--global-batch {args.global_batch} must divide by {dp_size} data-parallel ranks")

    torch.manual_seed(0)
    module, example = digits_cnn(local_batch)
    model = raf_dist.frontend.from_pytorch(module, (example,))
    trainer = raf_dist.Trainer(model, loss="cross_entropy", optimizer=raf_dist.optim.Adam(lr=args.lr),
                               device=args.device)
    if comm.rank == 0:
        print(f"raf_dist: {comm.size} rank(s) on {sorted(set(comm.hosts))} ({args.device}), global batch "
              f"{args.global_batch}, {model.num_params()} parameters, config {dist.get_config().as_dict()}")
        if trainer.tp_plan is not None:
            print(f"{mesh}\n{trainer.tp_plan.explain()}", flush=True)
        if args.pp > 1:
            print(f"{mesh}\n{trainer.plan.describe()}", flush=True)

    first_epoch = 0
    if args.checkpoint and (Path(args.checkpoint) / "latest").exists():
        first_epoch = trainer.load_checkpoint(args.checkpoint)["epoch"]
        if comm.rank == 0:
            print(f"resumed from {args.checkpoint} at epoch {first_epoch} (step "
                  f"{trainer.step_count})", flush=True)
    steps = raf_dist.data.num_steps(len(x_train), args.global_batch)
    for epoch in range(first_epoch, args.epochs):
        batches = raf_dist.data.shard((x_train, y_train), args.global_batch, shuffle=True,
                                      seed=0, epoch=epoch, rank=dp_rank, world_size=dp_size)
        losses = []
        with tqdm(batches, total=steps, desc=f"epoch {epoch + 1}/{args.epochs}",
                  disable=comm.rank != 0 or not sys.stderr.isatty(), leave=False) as bar:
            for xb, yb in bar:
                losses.append(trainer.step(xb, yb))
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
        # held-out accuracy: each data-parallel index scores its share of the test set
        share = np.array_split(np.arange(len(x_test)), dp_size)[dp_rank]
        predictions = trainer.predict(x_test[share]).argmax(axis=1)
        correct = dist.allreduce(np.array([np.sum(predictions == y_test[share])], np.int64),
                                 group=mesh.dp_group if mesh else None)[0]
        if comm.rank == 0:
            print(f"epoch {epoch + 1}: mean loss {np.mean(losses):.4f}, held-out accuracy "
                  f"{correct / len(x_test):.3f}", flush=True)
        if args.checkpoint:
            trainer.save_checkpoint(args.checkpoint, extra={"epoch": epoch + 1})
    if comm.rank == 0:
        stats = trainer.stats()
        print(f"last step sent {stats['comm_bytes_last_step']} bus bytes; "
              f"planned step memory {stats['planned_peak_bytes']} bytes")


if __name__ == "__main__":
    main()

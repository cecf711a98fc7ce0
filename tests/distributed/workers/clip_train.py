"""Clipping by the global gradient norm (Trainer(max_grad_norm=...)) and optimizer parameter
groups on a mesh vs one process on the global batch, which tests/numeric/test_training_loop.py
holds to torch.nn.utils.clip_grad_norm_ and to torch's param groups.

Usage: clip_train.py MODEL LAYOUT[,LAYOUT...] [STEPS]
LAYOUT: "pp{P}.tp{T}.z{Z}.m{M}" (any part may be left out: 1, 1, 0, 1), or "dp" (all left
out); dp = N / (P x T).
MAX_NORM is small enough that every step clips (the reference's norms are checked to exceed
it), so a norm counted twice or half (a tensor-parallel duplicate, a ZeRO shard, a pipeline
stage, a tied parameter) changes every update. GROUPS give the bias and the positions no
weight decay and the tied embedding its own lr, so ZeRO's buckets hold one group each. Each layout's per-step norms, losses and final
parameters must equal the reference's (norm-relative <= TOL, the distributed tier's float32
summation-order tolerance), and every rank must report the very same norm.
Prints 'rank R: CLIP OK'."""
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, rel_err  # noqa: E402

GLOBAL_BATCH = 8
MAX_NORM = 0.05
TOL = 5e-5  # as pp_train.py / the ZeRO workers: float32 sums in another order per rank
GROUPS = [{"params": ["*.bias", "pos"], "weight_decay": 0.0}, {"params": ["tok.*"], "lr": 5e-3}]


def optimizer():
    return raf_dist.optim.AdamW(lr=1e-2, param_groups=GROUPS)


def parse(layout):
    parts = {"pp": 1, "tp": 1, "z": 0, "m": 1}
    for part in layout.split(".") if layout != "dp" else ():
        key = part.rstrip("0123456789")
        parts[key] = int(part[len(key):])
    return parts["pp"], parts["tp"], parts["z"], parts["m"]


def reference(name, steps):
    """Rank 0 alone on the global batch: (losses, norms, params), on every rank."""
    comm = dist.get_communicator()
    result = None
    if comm.rank == 0:
        module, x, y = make(name, GLOBAL_BATCH, seed=0)
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=optimizer(), local=True,
                                   max_grad_norm=MAX_NORM)
        losses, norms = [], []
        for _ in range(steps):
            losses.append(trainer.step(x.numpy(), y.numpy()))
            norms.append(trainer.last_grad_norm)
        result = (losses, norms, trainer.state_dict())
    comm.idle_barrier()
    return comm.mpi_comm.bcast(result, root=0)


def train(name, layout, steps):
    comm = dist.get_communicator()
    pp, tp, zero, micro = parse(layout)
    dp = comm.size // (pp * tp)
    dist.get_config().update({
        "pipeline_parallel_size": pp, "tensor_parallel_size": tp,
        "enable_data_parallel": dp > 1 or zero > 0, "zero_opt_level": zero,
        "num_microbatches": micro})
    mesh = dist.get_mesh()
    module, x, y = make(name, GLOBAL_BATCH, seed=0)
    local = GLOBAL_BATCH // dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=optimizer(), max_grad_norm=MAX_NORM)
    # the layout holds what the norm must count once: tensor-parallel pieces, tied
    # parameters on two pp ranks
    assert tp == 1 or trainer.tp_plan.placements, layout
    assert pp == 1 or name != "tied" or trainer.executor._tied, layout
    losses, norms = [], []
    for _ in range(steps):
        losses.append(trainer.step(x[rows].numpy(), y[rows].numpy()))
        norms.append(trainer.last_grad_norm)
    assert trainer.metrics()["grad_norm"] == norms[-1]
    return losses, norms, trainer.state_dict()


def main():
    name, layouts = sys.argv[1], sys.argv[2].split(",")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.set_num_threads(1)
    comm = dist.get_communicator()
    ref_losses, ref_norms, ref_params = reference(name, steps)
    assert min(ref_norms) > MAX_NORM, ref_norms  # every step clips
    for layout in layouts:
        losses, norms, params = train(name, layout, steps)
        everyone = comm.mpi_comm.allgather(norms)
        assert all(n == everyone[0] for n in everyone), (layout, everyone)
        err = max([rel_err(losses, ref_losses), rel_err(norms, ref_norms)]
                  + [rel_err(params[k], ref_params[k]) for k in ref_params])
        print(f"rank {comm.rank}: {name} {layout}: norms {np.round(norms, 6).tolist()} "
              f"(reference {np.round(ref_norms, 6).tolist()}), max rel err {err:.1e}")
        assert err <= TOL, (layout, err, norms, ref_norms, losses, ref_losses)
    print(f"rank {comm.rank}: CLIP OK")


if __name__ == "__main__":
    main()

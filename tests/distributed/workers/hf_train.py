"""Hugging Face GPT-2 (tests/hf.py: default sdpa attention, tied embedding and head) under plain
data parallelism and ZeRO-3 on N ranks vs one raf_dist process on the same global batch.

Usage: hf_train.py LEVEL[,LEVEL...] [STEPS]
For each level: losses, parameters and optimizer state equal the one-process run
(norm-relative <= 5e-5: float reduction order across ranks, amplified by Adam where a
gradient element is near eps; AdamW with eps 1e-6, see tests/hf.py; measured <= 5.5e-6), and
state_dict() is keyed as named_parameters() (the tied weight once). Prints 'rank R: ALL OK'."""
import sys
from pathlib import Path

import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf import make_hf, raf_adamw  # noqa: E402
from models import rel_err  # noqa: E402

GLOBAL_BATCH = 4
MODEL = "gpt2"
TOL = 5e-5  # see the docstring


def single_process_reference(steps):
    """Rank 0 trains the model alone on the whole global batch (data parallelism off) while the
    others wait; every rank gets (losses, state_dict, optimizer_state_dict). Collective."""
    comm = dist.get_communicator()
    reference = None
    if comm.rank == 0:
        dist.get_config().update({"enable_data_parallel": False, "zero_opt_level": 0})
        module, x, y = make_hf(MODEL, GLOBAL_BATCH)
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_adamw(), local=True)
        losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(steps)]
        reference = (losses, trainer.state_dict(), trainer.optimizer_state_dict())
    comm.idle_barrier()  # the others sleep while rank 0 compiles and runs the reference
    return comm.mpi_comm.bcast(reference, root=0)


def main():
    levels = [int(v) for v in sys.argv[1].split(",")]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(1)  # the ranks share the machine's cores
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    ref_losses, ref_params, ref_states = single_process_reference(steps)
    for level in levels:
        module, x, y = make_hf(MODEL, GLOBAL_BATCH)
        names = [name for name, _ in module.named_parameters()]
        local = GLOBAL_BATCH // n
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                                  "bucket_size_mb": 0.01})  # several buckets
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                                   optimizer=raf_adamw())
        losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
        what = f"{MODEL} level {level} N={n}"
        assert rel_err(losses, ref_losses) <= TOL, (what, losses, ref_losses)
        assert trainer.num_grad_buckets > 1, (what, trainer.num_grad_buckets)
        params = trainer.state_dict()  # gathers under ZeRO-3: every rank calls it
        assert list(params) == names, (what, list(params))
        for key, value in ref_params.items():
            assert rel_err(params[key], value) <= TOL, (what, key, rel_err(params[key], value))
        states = trainer.optimizer_state_dict()
        assert sorted(states) == sorted(names), (what, list(states))  # ZeRO: bucket order
        for key, by_state in ref_states.items():
            for state, value in by_state.items():
                err = rel_err(states[key][state], value)
                assert err <= TOL, (what, key, state, err)
    dist.get_config().reset()
    print(f"rank {rank}: ALL OK")


if __name__ == "__main__":
    main()

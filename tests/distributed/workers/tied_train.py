"""A tied-weight model (tests/models.py TiedLM: head.weight is tok.weight, as GPT-2) under
plain data parallelism and ZeRO-3 on N ranks vs one process on the same global batch.

Usage: tied_train.py LEVEL[,LEVEL...] [STEPS]
For each level: losses, parameters and optimizer state equal the one-process run
(norm-relative <= 2e-5: float reduction order across ranks), state_dict() is keyed as
named_parameters() (the tied weight once), and the tied weight is held, sharded and reduced
once (one gradient, one optimizer state). Prints 'rank R: ALL OK'."""
import sys

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 4


def main():
    levels = [int(v) for v in sys.argv[1].split(",")]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    ref_losses, ref_params, ref_states = single_process_reference("tied", "adamw", GLOBAL_BATCH,
                                                                  steps)
    for level in levels:
        module, x, y = make("tied", GLOBAL_BATCH, seed=0)
        names = [name for name, _ in module.named_parameters()]
        local = GLOBAL_BATCH // n
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                                  "bucket_size_mb": 0.0005})
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                                   optimizer=raf_optimizer("adamw"))
        losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
        what = f"tied level {level} N={n}"
        assert rel_err(losses, ref_losses) <= 2e-5, (what, losses, ref_losses)
        assert trainer.signature.param_names == names, (what, trainer.signature.param_names)
        params = trainer.state_dict()  # gathers under ZeRO-3: every rank calls it
        assert list(params) == names, (what, list(params))
        for key, value in ref_params.items():
            assert rel_err(params[key], value) <= 2e-5, (what, key, rel_err(params[key], value))
        states = trainer.optimizer_state_dict()
        assert sorted(states) == sorted(names), (what, list(states))  # ZeRO: bucket order
        for key, by_state in ref_states.items():
            for state, value in by_state.items():
                err = rel_err(states[key][state], value)
                assert err <= 2e-5, (what, key, state, err)
    print(f"rank {rank}: ALL OK")


if __name__ == "__main__":
    main()

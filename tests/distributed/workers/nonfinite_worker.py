"""A NaN in one rank's batch under Trainer(nonfinite="skip"), plain data parallelism and ZeRO:
every rank returns NaN for that step and skips the update together, so good, NaN, good ends
where one process doing good, good on the global batch ends.

Usage: nonfinite_worker.py LEVEL[,LEVEL...]. Prints 'rank R: SKIP OK'."""
import math
import sys

import numpy as np

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 8


def main():
    comm = dist.get_communicator()
    ref_losses, ref_params, _ = single_process_reference("mlp", "adamw", GLOBAL_BATCH, 2)
    for level in map(int, sys.argv[1].split(",")):
        dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                                  "bucket_size_mb": 0.001})
        module, x, y = make("mlp", GLOBAL_BATCH)
        local = GLOBAL_BATCH // comm.size
        rows = slice(comm.rank * local, (comm.rank + 1) * local)
        xs, ys = x[rows].numpy(), y[rows].numpy()
        bad = xs.copy()
        if comm.rank == comm.size - 1:  # the NaN is on the last rank only
            bad[0, 0] = np.nan
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                                   optimizer=raf_optimizer("adamw"), nonfinite="skip")
        losses = [trainer.step(xs, ys), trainer.step(bad, ys), trainer.step(xs, ys)]
        assert math.isnan(losses[1]), (level, losses)
        assert rel_err([losses[0], losses[2]], ref_losses) <= 2e-5, (level, losses, ref_losses)
        params = trainer.state_dict()
        for key, value in ref_params.items():
            assert rel_err(params[key], value) <= 2e-5, (level, key)
        assert trainer.skipped_steps == 1 and trainer.step_count == 3
    print(f"rank {comm.rank}: SKIP OK")


if __name__ == "__main__":
    main()

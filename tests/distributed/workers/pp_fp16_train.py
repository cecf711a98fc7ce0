"""fp16 under pipelining (2 stages, 2 microbatches) against one process in fp16 accumulating
the same 2 microbatches, on the
overflow case of tests/numeric/test_mixed_precision.py: an MSE regression with targets of
size 20, whose output gradient overflows float16 at the initial loss scale of 2^16. The
pipeline scales the last stage's seeds, so the overflow happens in the dy sent back to the
first stage; the update must be skipped on both ranks and the scale halved exactly where one
process skips: the scale sequence and the skipped steps are equal, and the parameters of
the steps taken are within TOL_FACTOR x one process's own fp16-vs-fp32 distance (the
pipeline rounds the activation between the stages to float16 once more).

Usage: pp_fp16_train.py. Prints 'rank R: ALL OK'."""
import sys
from pathlib import Path

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import rel_err  # noqa: E402

STEPS = 6
TOL_FACTOR = 3.0  # as tests/numeric/test_mixed_precision.py


def make():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                 torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    return module, x, 20.0 * torch.randn(8, 4)


def run(precision, pp, steps):
    """(losses, loss scales, parameters, skipped steps) of ``steps`` steps."""
    # one process accumulates the same 2 microbatches: where float16 overflows depends on
    # the rows a product sums (a weight gradient over 8 rows overflows at a scale where two
    # over 4 rows, accumulated in float32, do not)
    dist.get_config().update({"pipeline_parallel_size": pp, "enable_data_parallel": False,
                              "num_microbatches": 2})
    module, x, y = make()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)), loss="mse",
                               optimizer=raf_dist.optim.SGD(lr=1e-3), precision=precision,
                               local=pp == 1)
    losses, scales = [], []
    for _ in range(steps):
        losses.append(trainer.step(x.numpy(), y.numpy()))
        scales.append(trainer.loss_scale)
    return losses, scales, trainer.state_dict(), trainer.skipped_steps


def main():
    comm = dist.get_communicator()
    reference = None
    if comm.rank == 0:  # one process: fp16, then fp32 for as many updates as it took
        fp16 = run("fp16", 1, STEPS)
        taken = sum(np.isfinite(v) for v in fp16[0])
        fp32 = run("fp32", 1, taken)
        reference = (fp16, fp32)
    comm.idle_barrier()
    (ref_losses, ref_scales, ref_params, ref_skipped), (_, _, fp32_params, _) = \
        comm.mpi_comm.bcast(reference, root=0)
    assert ref_skipped >= 1 and ref_scales[0] < 2.0 ** 16, ref_scales  # the case overflows

    losses, scales, params, skipped = run("fp16", 2, STEPS)
    assert scales == ref_scales, (scales, ref_scales)
    assert [np.isfinite(v) for v in losses] == [np.isfinite(v) for v in ref_losses], (
        losses, ref_losses)
    assert skipped == ref_skipped, (skipped, ref_skipped)
    spread = max(rel_err(ref_params[k], fp32_params[k]) for k in ref_params)
    err = max(rel_err(params[k], ref_params[k]) for k in ref_params)
    print(f"rank {comm.rank}: scales {scales}, skipped {skipped}; parameters {err:.2e} from "
          f"one process's fp16 (its distance from fp32: {spread:.2e})")
    assert 0 < spread and err <= TOL_FACTOR * spread, (err, spread)
    assert all(v.dtype == np.float32 for v in params.values())  # float32 masters
    print(f"rank {comm.rank}: ALL OK")


if __name__ == "__main__":
    main()

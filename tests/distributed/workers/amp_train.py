"""Mixed precision on N = 2 ranks vs one process in the same precision on the same global
batch.

Usage: amp_train.py MODEL LAYOUT[,LAYOUT...] [STEPS]
LAYOUT: dp | zero1 | zero2 | zero3 | tp (tensor_parallel_size = N) | pp (two pipeline stages x
N/2 data parallel, 2 microbatches, 1F1B; the activations between stages in bf16), with
"+bf16grads" for
grad_reduce_dtype="bfloat16", and "@fp16" for precision="fp16" (dynamic loss scaling: the
scale must also be the reference's) instead of "bf16". Rank 0 trains the references alone:
the low precision and fp32. Each layout must give its reference's losses and parameters within TOL_FACTOR x the bf16 reference's
own distance from fp32 (the size of bf16's rounding on this case, measured in the same run, so
the verdict does not depend on the machine): the layouts round other partial sums to bf16 (a
rank's half of a weight gradient), never more often. Parameters must be float32. With
+bf16grads the gradient bus bytes are half of the same layout's float32 ones, give or take
the 64-byte alignment each gradient has in a data-parallel bucket (bucketing.py), which
travels with it.
Prints 'rank R: ALL OK'."""
import sys

import numpy as np

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 8
# measured: dp / ZeRO 0.01-0.5, tp 0.78 of the spread (transformer); a layout that silently
# computed in float32 would sit at 1.0, so the step IR is also checked for bf16 matmuls
TOL_FACTOR = 1.5


def train(name, layout, steps, n, rank):
    config = {"enable_data_parallel": True, "zero_opt_level": 0, "tensor_parallel_size": 1,
              "pipeline_parallel_size": 1, "num_microbatches": 1}
    layout, _, precision = layout.partition("@")
    kind, _, grads = layout.partition("+")
    if kind.startswith("zero"):
        config["zero_opt_level"] = int(kind[4:])
    if kind == "tp":
        config.update(enable_data_parallel=False, tensor_parallel_size=n)
    if kind == "pp":  # two stages; data parallel over the rest of the ranks
        config.update(enable_data_parallel=n > 2, pipeline_parallel_size=2, num_microbatches=2)
    dist.get_config().update(config)
    module, x, y = make(name, GLOBAL_BATCH, seed=0)
    if kind == "tp":  # every rank reads the global batch
        parts, part = 1, 0
    elif kind == "pp":
        parts, part = n // 2, dist.get_mesh().dp_rank
    else:
        parts, part = n, rank
    local = GLOBAL_BATCH // parts
    xs, ys = x[part * local:(part + 1) * local], y[part * local:(part + 1) * local]
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                               optimizer=raf_optimizer("adamw"), precision=precision or "bf16",
                               grad_reduce_dtype="bfloat16" if grads else "float32")
    dtype = "float16" if precision == "fp16" else "bfloat16"
    if kind == "pp":  # this rank's stage: bf16 matmuls; the activation between stages
        rows = local // 2  # a microbatch
        stages = trainer.executor._stage_set(rows).stages
        for stage in stages.values():
            assert f'dtype="{dtype}") = R.matmul(' in stage.functions.mod.script(), layout
        boundary = trainer.executor._stage_set(rows).boundary_specs[0]
        assert boundary[1] == dtype, boundary  # half the bytes of each message
    else:
        assert f'dtype="{dtype}") = R.matmul(' in trainer.executor.ir.script(), layout
    losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
    if kind == "pp":  # stage 0 sends each microbatch's activation, stage 1 its gradient back
        sent = trainer.stats()["comm_bytes_last_step"]["send"]
        assert sent == 2 * int(np.prod(boundary[0])) * 2, (sent, boundary)  # 2 bytes each
    return (losses, trainer.state_dict(), trainer.stats()["comm_bytes_last_step"],
            trainer.loss_scale)


def main():
    name, layouts = sys.argv[1], sys.argv[2].split(",")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    fp_losses, fp_params, _ = single_process_reference(name, "adamw", GLOBAL_BATCH, steps)
    references = {}
    traffic = {}
    for layout in layouts:
        precision = layout.partition("@")[2] or "bf16"
        if precision not in references:  # (losses, params, tolerance, loss scale)
            ref_losses, ref_params, _, kept = single_process_reference(
                name, "adamw", GLOBAL_BATCH, steps, keep=("loss_scale",), precision=precision)
            scale = kept["loss_scale"]
            spread = max(rel_err(ref_losses, fp_losses),
                         max(rel_err(ref_params[k], fp_params[k]) for k in fp_params))
            assert spread > 0, f"{precision} gave the float32 result: nothing was low precision"
            references[precision] = (ref_losses, ref_params, TOL_FACTOR * spread, scale)
        ref_losses, ref_params, tol, ref_scale = references[precision]
        losses, params, comm_bytes, scale = train(name, layout, steps, n, rank)
        assert scale == ref_scale, (layout, scale, ref_scale)
        traffic[layout] = comm_bytes
        err = max([rel_err(losses, ref_losses)]
                  + [rel_err(params[k], ref_params[k]) for k in ref_params])
        print(f"rank {rank}: {name} {layout}: max rel err {err:.2e} (tolerance {tol:.2e})")
        assert err <= tol, (layout, err, tol, losses, ref_losses)
        assert all(params[k].dtype == np.float32 for k in params), layout
        base = layout.partition("+")[0]
        if layout.endswith("+bf16grads") and base not in traffic:  # half of nothing measured
            print(f"rank {rank}: {layout}: {comm_bytes}")
        if layout.endswith("+bf16grads") and base in traffic:
            full, half = traffic[base], comm_bytes
            kinds = [k for k in full if k in ("allreduce", "reduce_scatter")]
            loss = 2 * (n - 1) / n * 4 if base.startswith("zero") or base == "dp" else 0
            for k in kinds:
                grads_full = full[k] - (loss if k == "allreduce" else 0)
                grads_half = half[k] - (loss if k == "allreduce" else 0)
                slack = len(params) * 64 * 2 * (n - 1) / n  # alignment, at most 64 B each
                assert 0 <= grads_half - grads_full / 2 <= slack, (layout, k, full, half)
                print(f"rank {rank}: {layout}: {k} {grads_half:.0f} B vs {grads_full:.0f} B "
                      "in float32")
    print(f"rank {rank}: ALL OK")


if __name__ == "__main__":
    main()

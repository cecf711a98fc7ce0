"""Distributed tier for mixed precision: bf16 on 2 ranks equals bf16 on one process on the
global batch (within a bf16-calibrated tolerance, workers/amp_train.py) under data
parallelism with float32 and bfloat16 gradient traffic (half the bytes), ZeRO-3 and tensor
parallelism. Real mpiexec under a hard timeout."""
from mpi_launch import assert_ranks_ok, check_mpi, run_mpi


def test_bf16_layouts_match_single_process():
    out = check_mpi("amp_train.py", 2, "transformer", "dp,dp+bf16grads,zero3,tp", timeout=480)
    assert_ranks_ok(out, 2)
    assert "dp+bf16grads: allreduce" in out, out


def test_bf16_gradients_under_zero_are_refused_at_construction():
    code, out, _ = run_mpi("amp_train.py", 2, "mlp", "zero1+bf16grads", timeout=240)
    assert code != 0
    assert "grad_reduce_dtype='bfloat16' with zero_opt_level=1 is not built yet" in out, out

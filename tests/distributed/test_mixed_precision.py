"""Distributed tier for mixed precision: bf16 on 2 ranks equals bf16 on one process on the
global batch (within a bf16-calibrated tolerance, workers/amp_train.py) under data
parallelism with float32 and bfloat16 gradient traffic (half the bytes), ZeRO-3 with bf16
gradient shards, and tensor parallelism. Real mpiexec under a hard timeout."""
from mpi_launch import assert_ranks_ok, check_mpi


def test_bf16_layouts_match_single_process():
    """One job: the data-parallel allreduce in float32 then bf16 (half the bytes), ZeRO-3
    with bf16 gradient shards, tensor parallelism (bf16 partial sums reduced over tp), and
    fp16 under ZeRO-2 (loss scaling through ShardZeRO's guard; the same scale as one process). The
    MLP compiles in seconds; bf16 softmax / layer norm numerics are the numeric tier's
    (tests/numeric/test_mixed_precision.py), the transformer at N = 2 was run by hand
    (dp / ZeRO-2 / tp within 0.5-0.8 of the bf16-vs-fp32 spread)."""
    out = check_mpi("amp_train.py", 2, "mlp",
                    "dp,dp+bf16grads,zero3+bf16grads,tp,zero2@fp16", timeout=480)
    assert_ranks_ok(out, 2)
    assert "dp+bf16grads: allreduce" in out, out

"""Distributed tier for mixed precision: bf16 on 2 ranks equals bf16 on one process on the
global batch (within a bf16-calibrated tolerance, workers/amp_train.py) under data
parallelism with float32 and bfloat16 gradient traffic (half the bytes), ZeRO-3 with bf16
gradient shards, tensor parallelism and pipelining (bf16 activations between the stages).
Real mpiexec under a hard timeout."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


def test_bf16_layouts_match_single_process():
    """One job: the data-parallel allreduce in float32 then bf16 (half the bytes), ZeRO-3
    with bf16 gradient shards, tensor parallelism (bf16 partial sums reduced over tp), two
    pipeline stages (AutoCast per stage, the activation and its gradient sent in bf16; and in
    fp16 with the loss scale on the last stage's seeds, the same scales as one process), and
    fp16 under ZeRO-2 (loss scaling through ShardZeRO's guard; the same scale as one process). The
    MLP compiles in seconds; bf16 softmax / layer norm numerics are the numeric tier's
    (tests/numeric/test_mixed_precision.py), the transformer at N = 2 was run by hand
    (dp / ZeRO-2 / tp within 0.5-0.8 of the bf16-vs-fp32 spread)."""
    out = check_mpi("amp_train.py", 2, "mlp",
                    "dp,dp+bf16grads,zero3+bf16grads,tp,pp,pp@fp16,zero2@fp16", timeout=600)
    assert_ranks_ok(out, 2)
    assert "dp+bf16grads: allreduce" in out, out


def test_fp16_pipeline_skips_overflows_as_one_process():
    """fp16 with two pipeline stages: the loss scale rides on the last stage's seeds, an
    overflow in the gradient sent back skips the update on both ranks, and the scales and
    skipped steps equal one process's (workers/pp_fp16_train.py)."""
    out = check_mpi("pp_fp16_train.py", 2, timeout=300)
    assert_ranks_ok(out, 2)


@pytest.mark.slow
def test_bf16_pipeline_with_data_parallel_halves_the_gradient_allreduce():
    """Two stages x two data-parallel ranks in bf16 equal one process; with
    grad_reduce_dtype="bfloat16" the update's dp allreduce moves half the float32 bytes (give
    or take each gradient's bucket alignment). 4 ranks on 2 cores: make test-slow."""
    out = check_mpi("amp_train.py", 4, "mlp", "pp,pp+bf16grads", timeout=800)
    assert_ranks_ok(out, 4)
    assert "pp+bf16grads: allreduce" in out, out

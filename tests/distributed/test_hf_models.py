"""Distributed tier for a Hugging Face model: GPT-2 (default sdpa attention, tied embedding and
head; tests/hf.py) trains on 2 ranks under plain data parallelism and ZeRO-3 exactly as one
process on the global batch (workers/hf_train.py). One mpiexec run checks both levels."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi

pytest.importorskip("transformers")


# make test-slow: tied weights under DP and ZeRO-3 are test_model_params'
# test_tied_weights_under_data_parallel_and_zero3 (the same checks), an attention LM at ZeRO
# levels 0-3 test_zero's transformer case, Hugging Face GPT-2 across ranks test_tensor_parallel's
@pytest.mark.slow
def test_gpt2_under_data_parallel_and_zero3_matches_one_process():
    out = check_mpi("hf_train.py", 2, "0,3", timeout=480)
    assert_ranks_ok(out, 2)

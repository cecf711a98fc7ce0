"""Distributed tier for a Hugging Face model: GPT-2 (default sdpa attention, tied embedding and
head; tests/hf.py) trains on 2 ranks under plain data parallelism and ZeRO-3 exactly as one
process on the global batch (workers/hf_train.py). One mpiexec run checks both levels."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi

pytest.importorskip("transformers")


def test_gpt2_under_data_parallel_and_zero3_matches_one_process():
    out = check_mpi("hf_train.py", 2, "0,3", timeout=480)
    assert_ranks_ok(out, 2)

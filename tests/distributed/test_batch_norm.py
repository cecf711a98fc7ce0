"""Batch norm running statistics under data parallelism on 2 real ranks (MPI): synchronized
batch norm equals one process on the global batch; the default keeps rank 0's statistics as
DDP's broadcast_buffers does. The worker (workers/bn_train.py) compares against PyTorch."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


# the MLP: make test-slow (the CNN's per-channel statistics prove the same; synchronized batch
# norm also runs pipelined and under ZeRO-3 in test_pipeline.py and test_vision_models.py)
@pytest.mark.parametrize("model", [pytest.param("bn_mlp", marks=pytest.mark.slow), "bn_cnn"])
def test_batch_norm_on_two_ranks(model):
    out = check_mpi("bn_train.py", 2, model, 3, timeout=300)
    assert_ranks_ok(out, 2)

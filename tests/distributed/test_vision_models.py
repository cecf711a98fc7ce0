"""Distributed tier for a real vision model: torchvision's ResNet (BatchNorm; GELU and average
pooling, so that the comparison is smooth: tests/vision.py) with synchronized batch norm on 2
ranks, under plain data parallelism and ZeRO-3, equals one float64 PyTorch process on the
global batch (parameters and running statistics); its ZeRO-3 checkpoint, written by 2 ranks,
resumes on 3 ranks (ZeRO-2) as if training had never stopped (workers/vision_train.py, whose
TOL says where its tolerance comes from)."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


def _all_ok(out, nprocs):
    print("\n".join(line for line in out.splitlines() if " apart" in line))  # measured errors
    assert_ranks_ok(out, nprocs)


@pytest.mark.slow  # 41 s: make test-slow (stop 71, for time; synchronized batch norm over dp:
# test_pipeline's pp2xdp2 case and test_batch_norm.py; ZeRO-3 resharding: test_checkpoint.py)
def test_resnet_sync_batch_norm_zero3_and_checkpoint_on_2_then_3_ranks(tmp_path):
    directory = tmp_path / "ckpt"
    _all_ok(check_mpi("vision_train.py", 2, "train", directory, timeout=600), 2)
    _all_ok(check_mpi("vision_train.py", 3, "load", directory, timeout=600), 3)

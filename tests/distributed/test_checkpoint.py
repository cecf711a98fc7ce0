"""Distributed tier for checkpoints (workers/ckpt_train.py): exact resume, resharding across
world sizes and ZeRO levels, a save killed half way, ranks that disagree on the model, a
damaged checkpoint. Every run has a hard timeout. (A rank that fails, is killed or stalls
mid-step: the fault-injection matrix, test_faults.py.)"""
import re
import time

import pytest

from mpi_launch import assert_ranks_ok, check_mpi, run_mpi


@pytest.mark.parametrize("nprocs, level", [(2, 3), (3, 2)])
def test_resume_is_bitwise_exact(tmp_path, nprocs, level):
    assert_ranks_ok(check_mpi("ckpt_train.py", nprocs, "resume", tmp_path / "ckpt", level,
                              timeout=300), nprocs)


# 2 -> 3 ranks, plain dp -> ZeRO-2: make test-slow (world size and level both change in the
# first case and in test_dist_example_resumes_on_another_world_size_and_level)
@pytest.mark.parametrize("saved, loaded", [((4, 3), (2, 1)),
                                           pytest.param((2, 0), (3, 2), marks=pytest.mark.slow)],
                         ids=["4r-zero3-to-2r-zero1", "2r-dp-to-3r-zero2"])
def test_reshard_on_load(tmp_path, saved, loaded):
    directory = tmp_path / "ckpt"
    check_mpi("ckpt_train.py", saved[0], "save", directory, saved[1], timeout=300)
    assert_ranks_ok(check_mpi("ckpt_train.py", loaded[0], "load", directory, loaded[1],
                              timeout=300), loaded[0])


def test_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    code, out, _ = run_mpi("ckpt_train.py", 2, "kill_in_save", directory, 2, timeout=120)
    assert code != 0, out
    assert (directory / "latest").read_text().strip() == "step-00000002"
    assert list(directory.glob(".tmp-step-00000003.*"))  # the interrupted save, ignored
    assert_ranks_ok(check_mpi("ckpt_train.py", 3, "check_saved", directory, 3, timeout=300), 3)


def test_ranks_with_different_steps_refuse_to_start(tmp_path):
    code, out, _ = run_mpi("ckpt_train.py", 2, "mismatch", tmp_path, timeout=120)
    assert code != 0, out
    # the agreement at Trainer construction, before any other collective
    assert "ranks built different Trainers" in out and "differs from rank 0 in optimizer" in out, out


def test_damaged_shard_fails_every_rank_cleanly(tmp_path):
    directory = tmp_path / "ckpt"
    check_mpi("ckpt_train.py", 2, "save", directory, 2, timeout=300)
    shard = directory / "step-00000003" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x55
    shard.write_bytes(bytes(data))
    before = shard.read_bytes()
    start = time.monotonic()
    code, out, _ = run_mpi("ckpt_train.py", 2, "load", directory, 1, timeout=120)
    assert code != 0 and time.monotonic() - start < 60, out
    assert "rank00001.safetensors is corrupted" in out, out
    assert shard.read_bytes() == before


def test_each_rank_checksums_only_the_files_it_reads(tmp_path):
    """At the same world size under ZeRO-3 rank r reads only file r: a damaged rank00001 is
    found by rank 1 alone (rank 0 no longer hashes it), and every rank still refuses."""
    directory = tmp_path / "ckpt"
    check_mpi("ckpt_train.py", 2, "save", directory, 3, timeout=300)
    shard = directory / "step-00000003" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x55
    shard.write_bytes(bytes(data))
    code, out, _ = run_mpi("ckpt_train.py", 2, "load", directory, 3, timeout=120)
    assert code != 0, out
    assert "rank 1: " in out and "rank00001.safetensors is corrupted" in out, out
    assert "rank 0: " not in out, out


# make test-slow: test_reshard_on_load changes world and level against one process, and the
# example trains in test_dist_example_trains_on_two_ranks
@pytest.mark.slow
def test_dist_example_resumes_on_another_world_size_and_level(tmp_path):
    from mpi_launch import ROOT

    example = ROOT / "scripts" / "distributed" / "dist_example.py"
    first = check_mpi(example, 2, "--epochs", "1", "--zero-level", "3", "--checkpoint",
                      tmp_path / "ckpt", timeout=300)
    assert "epoch 1:" in first, first
    second = check_mpi(example, 4, "--epochs", "2", "--zero-level", "1", "--checkpoint",
                       tmp_path / "ckpt", timeout=300)
    assert "resumed from" in second and "at epoch 1" in second and "epoch 1:" not in second, second
    accuracy = float(re.findall(r"held-out accuracy ([0-9.]+)", second)[-1])
    assert accuracy >= 0.8, second

"""Distributed tier for clipping by the global gradient norm (Trainer(max_grad_norm=...)):
every layout's norms, losses and parameters equal one process on the global batch
(workers/clip_train.py; one process equals torch.nn.utils.clip_grad_norm_ in
tests/numeric/test_training_loop.py). The tied-embedding LM puts each way of counting an
element twice in play: tensor-parallel duplicates (replicated parameters), ZeRO shards,
pipeline stages, the tied embedding on two pp ranks. Real mpiexec under a hard timeout."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("ranks,layouts", [
    # make test-slow: ZeRO and tp with dp in the 4-rank job; clipping over plain dp in
    # test_embedding_parallel's row-sgd-3-sparse-clip
    pytest.param(2, "dp,z2,tp2", marks=pytest.mark.slow),
    # make test: tp's replicated parameters beside ZeRO-3's shards, and pp's stages with the
    # tied embedding on two pp ranks beside tp (one 4-rank job, 30 s); test-slow adds ZeRO-1
    # beside tp and beside pp, with microbatches
    (4, "tp2.z3,pp2.tp2.m2"),
    pytest.param(4, "tp2.z1.m2,pp2.z1.m2", marks=pytest.mark.slow),
], ids=["2-ranks", "4-ranks", "4-ranks-zero1"])
def test_clipping_counts_every_element_once(ranks, layouts):
    out = check_mpi("clip_train.py", ranks, "tied", layouts, timeout=600)
    assert_ranks_ok(out, ranks, marker="CLIP OK")

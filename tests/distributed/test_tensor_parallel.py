"""Tensor parallelism on real processes (workers/tp_train.py): T ranks (and dp x T with ZeRO)
train like one process on the global batch (a vocabulary T does not divide, padded, too),
with the plan's bus bytes on the tp group;
checkpoints reshard across tp x dp x ZeRO; bad layouts are refused on every rank before any
collective (workers/tp_errors.py)."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("model,optimizer,tp,zero,ranks,extra", [
    # column -> row pair, SGD with momentum; dp 2 x tp 2 with 3 microbatches of 2 + 1 + 1 rows
    # (gradient accumulation: the dp allreduce once per step)
    # (selective recomputation of activations: passes/remat.py)
    ("mlp", "sgd_momentum", 2, 0, 4, ("--microbatches", 3, "--recompute", "selective")),
    # heads over 4 ranks, vocab-parallel head: make test-slow (the same splits at tp 2 in the
    # ZeRO-3 case below; tp 4's plan and collectives in tests/passes/test_tensor_parallel.py)
    pytest.param("transformer4", "adamw", 4, 0, 4, (), marks=pytest.mark.slow),
    # dp 2 x tp 2, ZeRO-3 over dp, full recomputation
    ("transformer4", "sgd_momentum", 2, 3, 4, ("--recompute", "full")),
    # fused qkv, tied vocab-parallel embedding; a vocabulary of 37 (as GPT-2's 50257, odd):
    # padded to 38, the padded logits masked (divisible vocabularies: the cases above)
    ("hf_gpt2", "hf_adamw", 2, 0, 2, ("--vocab", 37)),
    # grouped-query attention, rotary, SwiGLU; an untied table (103 rows > the 64 ids a step
    # looks up: split) and head, each padded to 104
    # (make test-slow since stop 71, for time: padding is GPT-2's case above, Llama at tp 2
    # test_context_parallel's cp x tp)
    pytest.param("hf_llama", "hf_adamw", 2, 0, 2, ("--vocab", 103), marks=pytest.mark.slow),
], ids=["mlp-dp2xtp2-microbatches-selective", "transformer-tp4",
        "transformer-dp2xtp2-zero3-full",
        "gpt2-tp2-vocab37", "llama-tp2-vocab103"])
def test_tensor_parallel_equals_one_process(model, optimizer, tp, zero, ranks, extra):
    out = check_mpi("tp_train.py", ranks, model, optimizer, tp, zero, 3, *extra, timeout=420)
    assert_ranks_ok(out, ranks, "TP OK")
    assert "colwise" in out and "rowwise" in out
    if "--recompute" in extra:
        assert "values recomputed" in out, out
    if "--vocab" in extra:  # tp_train.py checked shapes and values; the plan says it padded
        assert "the vocabulary of %s is padded" % extra[extra.index("--vocab") + 1] in out, out


@pytest.mark.slow  # 95 s: make test-slow (dp x ZeRO resharding: test_checkpoint.py)
def test_checkpoint_reshards_across_tp_dp_and_zero(tmp_path):
    """Saved at dp 2 x tp 2 (ZeRO-1), resumed at dp 4 (ZeRO-2, no tp) and at tp 4: each
    continues exactly as one process that never stopped."""
    ckpt = tmp_path / "ckpt"
    assert_ranks_ok(check_mpi("tp_train.py", 4, "transformer4", "adamw", 2, 1, 2, "--save", ckpt,
                              timeout=300), 4, "TP OK")
    assert_ranks_ok(check_mpi("tp_train.py", 4, "transformer4", "adamw", 1, 2, 2, "--load", ckpt,
                              timeout=300), 4, "TP OK")
    assert_ranks_ok(check_mpi("tp_train.py", 4, "transformer4", "adamw", 4, 0, 2, "--load", ckpt,
                              timeout=300), 4, "TP OK")


@pytest.mark.parametrize("case,ranks,message", [
    ("world", 3, "does not split into pp x dp x tp"),
    # every row of the refusal table is tested in one process (tests/unit/
    # test_parallel_layout.py); one mpiexec case proves each rank refuses before any collective
    pytest.param("no_dp", 4, "enable_data_parallel", marks=pytest.mark.slow),
])  # an explicit plan that cannot split: tests/passes/test_tensor_parallel.py (one process)
def test_bad_layouts_are_refused_on_every_rank(case, ranks, message):
    out = check_mpi("tp_errors.py", ranks, case, timeout=120)
    assert_ranks_ok(out, ranks, "refused:")
    assert out.count("refused:") == ranks and out.count(message) >= ranks, out

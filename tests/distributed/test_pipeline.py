"""Pipeline parallelism on real processes (workers/pp_train.py): P stages on the pp axis, alone
and with data parallelism, ZeRO-1 and tensor parallelism, train like one process on the global
batch under every schedule; checkpoints saved at pp x dp resume at dp and at another pp; bad
layouts are refused on every rank before any collective."""
import re

import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("model,optimizer,pp,tp,zero,ranks,extra", [
    # 8 linear layers in 2 stages, GPipe (every stage holds M = 4 microbatches); row-wise
    # Adagrad: each stage's update holds one accumulator per row of its weights
    ("mlp8", "rowwise_adagrad", 2, 1, 0, 2, ("--schedule", "gpipe", "--microbatches", 4)),
    # 4 stages cut where the user says, 1F1B: stage s holds min(4 - s, 4)
    ("mlp8", "adamw", 4, 1, 0, 4, ("--schedule", "1f1b", "--microbatches", 4,
                                   "--split-points", "layers.2,layers.4,layers.6")),
    # 4 stages on 2 ranks (2 each), Megatron's interleaved order; selective recomputation:
    # each stage saves its matmul outputs, its backward recomputes the rest (P = 4 on real
    # ranks: the 1F1B case above)
    ("transformer", "adamw", 2, 1, 0, 2, ("--schedule", "interleaved_1f1b",
                                          "--microbatches", 4, "--checkpointing", "selective")),
    # Hugging Face GPT-2: the tied embedding / head on the first and last stage; an
    # activation budget (0.65 MB) between the stages' modelled activation memory without
    # recomputation (stage 0 holds 2 microbatches: 0.70 MB; stage 1 holds 1: 0.63 MB), so
    # recomputation is chosen for stage 0 alone (runtime/stage_budget.py)
    ("hf_gpt2", "hf_adamw", 2, 1, 0, 2, ("--microbatches", 2, "--budget", 0.65)),
    # dp 2 x pp 2 x tp 2 on 8 ranks, ZeRO-1 over dp (each stage split over two tp ranks,
    # the vocabulary-parallel head and loss on the last; pp x tp alone is this minus dp);
    # nanoGPT's flattened logits: each microbatch takes its share of the (batch * seq) targets
    # and raf_dist.proxies' extraction of this mesh's step equals what its last step ran
    ("flat_lm", "sgd_momentum", 2, 2, 1, 8, ("--microbatches", 2, "--check-extraction", 1)),
], ids=["mlp8-pp2-gpipe-rowwise-adagrad", "mlp8-pp4-1f1b-split-points", "transformer-pp2-interleaved-selective",
        "gpt2-pp2-tied-budget", "flat-lm-dp2xpp2xtp2-zero1"])
def test_pipeline_equals_one_process(model, optimizer, pp, tp, zero, ranks, extra):
    out = check_mpi("pp_train.py", ranks, model, optimizer, pp, tp, zero, 3, *extra,
                    timeout=480)
    assert_ranks_ok(out, ranks, "PP OK")
    if "--budget" in extra:  # the first stage recomputes, the last (1 microbatch) does not
        assert re.search(r"budget: rank 0 stages \[0\] recompute \{0: '(selective|full)'\}",
                         out), out[-3000:]
        assert "budget: rank 1 stages [1] recompute {1: False}" in out, out[-3000:]
    assert "pipeline stages" in out
    if "--check-extraction" in extra:
        assert out.count("extraction equals the step's collectives") == ranks, out


# without synchronized statistics (72 s): make test-slow; the synchronized case runs the same
# stages and microbatches with the statistics allreduced on top
@pytest.mark.parametrize("ranks,sync", [pytest.param(4, 0, marks=pytest.mark.slow), (4, 1)],
                         ids=["pp2xdp2", "pp2xdp2-sync-batch-norm"])
def test_batch_norm_pipelined_equals_one_process_accumulating(ranks, sync, tmp_path):
    """A residual CNN with BatchNorm after every convolution, 2 stages x 2 microbatches: each
    microbatch normalised by its own statistics, running statistics updated once per
    microbatch in order on the stage that owns them (workers/pp_bn_train.py)."""
    out = check_mpi("pp_bn_train.py", ranks, sync, 3, tmp_path, timeout=300)
    assert_ranks_ok(out, ranks, "PP BN OK")


def _save_at_dp2_pp2(ckpt, model):
    assert_ranks_ok(check_mpi("pp_train.py", 4, model, "adamw", 2, 1, 1, 2,
                              "--microbatches", 2, "--save", ckpt, timeout=300), 4, "PP OK")


@pytest.mark.slow  # 30 s: make test-slow (stop 71, for time; checkpoints across layouts:
# test_checkpoint.py's resharding and the cp / tp round trips)
def test_checkpoint_resumes_across_pp_and_dp(tmp_path):
    """Saved at dp 2 x pp 2 (ZeRO-1, 1F1B), resumed at dp 4 without pipelining: it continues
    exactly as one process that never stopped. The MLP (~55 s; the transformer took ~75 s):
    what moves is the layout of the files, the same for any model; the transformer's
    pipelined checkpoint is test-slow's pp -> pp case below."""
    ckpt = tmp_path / "ckpt"
    _save_at_dp2_pp2(ckpt, "mlp")
    assert_ranks_ok(check_mpi("tp_train.py", 4, "mlp", "adamw", 1, 1, 2, "--load", ckpt,
                              timeout=300), 4, "TP OK")


@pytest.mark.slow  # 85 s: make test-slow (the pp -> dp case above runs in make test)
def test_checkpoint_resumes_at_another_pp(tmp_path):
    """Saved at dp 2 x pp 2, resumed at pp 4 (GPipe): the same continuation."""
    ckpt = tmp_path / "ckpt"
    _save_at_dp2_pp2(ckpt, "transformer")
    assert_ranks_ok(check_mpi("pp_train.py", 4, "transformer", "adamw", 4, 1, 0, 2, "--schedule",
                              "gpipe", "--microbatches", 2, "--load", ckpt, timeout=300),
                    4, "PP OK")

"""Context and sequence parallelism on real processes (workers/cp_train.py): the sequence split
over cp ranks (ring and all-to-all), alone and with dp x ZeRO, tp (+ sequence_parallel) and
pp, and sequence parallelism alone, trains like one process on the
global batch, predict gathers the whole output, and the traffic is the method's (the ring's
send / recv per attention, or its all-to-alls). The rewrite and its refusals in one process:
tests/passes/test_context_parallel.py."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("model,optimizer,cp,method,tp,zero,ranks,flags", [
    # the long-sequence benchmark's LM in miniature (SDPA, is_causal), the ring on 2 ranks,
    # full recomputation (the ring forward again in the backward)
    ("sdpa_lm", "adamw", 2, "ring", 1, 0, 2, ("--recompute", "full")),
    # transformers Llama: rotary tables cut to each rank's positions, grouped-query heads
    # (4 query, 2 key/value) over 2 ranks by all-to-all; selective recomputation
    ("hf_llama", "hf_adamw", 2, "alltoall", 1, 0, 2, ("--recompute", "selective")),
    # transformers GPT-2: learned positions (wpe rows per rank, assembled by the gradient
    # reduction), tied head; dp 2 x cp 2 with ZeRO-1 sharding over the 4 ranks (its
    # checkpoint loads in one process)
    ("hf_gpt2", "hf_adamw", 2, "ring", 1, 1, 4, ()),
    # cp 2 x tp 2 with sequence_parallel: heads split over tp, each tp piece's sequence over
    # cp, the regions between the blocks over tp too; its checkpoint loads in one process
    ("hf_llama", "hf_adamw", 2, "ring", 2, 0, 4, ("--sp", 1)),
    # sequence parallelism alone (tp 2, cp 1): GPT-2's fused qkv, biases after g, learned
    # positions cut to each rank's tokens, the tied vocabulary-parallel head: make test-slow
    # (sequence_parallel's collectives and gradients: the cp 2 x tp 2 case above)
    pytest.param("hf_gpt2", "hf_adamw", 1, "ring", 2, 0, 2, ("--sp", 1), marks=pytest.mark.slow),
    # pp 2 x cp 2: each stage's attention over its cp group, 2 microbatches (1F1B)
    ("sdpa_lm", "adamw", 2, "ring", 1, 0, 4, ("--pp", 2, "--microbatches", 2)),
    # eager attention written with masked_fill (fused, the causal mask folded) and a learned
    # position parameter: make test-slow
    pytest.param("transformer4", "adamw", 2, "ring", 1, 0, 2, (), marks=pytest.mark.slow),
    # logits and targets flattened to (B * T, ...), all-to-all: make test-slow
    pytest.param("flat_lm", "adamw", 2, "alltoall", 1, 0, 2, (), marks=pytest.mark.slow),
    # four ranks round the ring (chunks r and 7 - r of 8): make test-slow
    pytest.param("sdpa_lm", "adamw", 4, "ring", 1, 0, 4, (), marks=pytest.mark.slow),
], ids=["sdpa-cp2-ring", "llama-cp2-alltoall", "gpt2-dp2xcp2-zero1", "llama-cp2xtp2-sp",
        "gpt2-tp2-sp", "sdpa-pp2xcp2", "eager-cp2-ring", "flat-cp2-alltoall", "sdpa-cp4-ring"])
def test_context_parallel_equals_one_process(model, optimizer, cp, method, tp, zero, ranks,
                                            flags):
    extra = tuple(flags) + (("--checkpoint",) if tp > 1 or zero > 0 else ())
    out = check_mpi("cp_train.py", ranks, model, optimizer, cp, method, tp, zero, 2, *extra,
                    timeout=420)
    assert_ranks_ok(out, ranks, "CP OK")

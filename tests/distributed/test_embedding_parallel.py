"""Embedding-table parallelism on real processes (workers/ep_train.py): a DLRM-style model's
tables sharded table-wise or row-wise over N ranks trains like one process on the global
batch (and that process like PyTorch), each rank holding its share of the table bytes, the
all-to-all bytes the analytic count; checkpoints reshard table-wise -> row-wise -> one
process; bad plans and bad ids are refused on every rank before any exchange
(workers/ep_errors.py)."""
import re

import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("mode,optimizer,ranks,extra", [
    # plain SGD: each table's looked-up rows updated in place (the sparse update), clipped by
    # the global norm (the rows' squares summed over the ranks). With the checkpoint chain
    # below (table-wise N=2, row-wise N=3) and ep_errors.py (a user plan at N=2) it is make
    # test's share; N=4 and the rest: make test-slow (~2 min). N=2 (25 rows of the category
    # table: blocks of 13 and 12, the last padded); row-wise at N=3 is the chain's
    # predict() after training (every rank passes the same 11 rows and computes 6 of them,
    # the last share padded: one forward at the captured size; the tables' lookups
    # exchanged as in a step)
    ("row", "sgd", 2, ("--clip", 0.1, "--predict", 11)),
    # four tables on four ranks, one placed by the user's plan (module name); the dense
    # tables' gradients clipped
    pytest.param("table", "adamw", 4, ("--plan", "tables.2=3", "--clip", 0.1),
                 marks=pytest.mark.slow),
    pytest.param("row", "sgd_momentum", 4, (), marks=pytest.mark.slow),
    pytest.param("table", "sgd", 3, (), marks=pytest.mark.slow),
    # the dense layers under ZeRO-3 over the same ranks (sharded and gathered), the tables
    # held whole by their holders outside the buckets; an activation budget of 0.0087 MB
    # (9122 bytes): the larger rank's step (its tables, the bags it pools) plans 9160 bytes
    # without recomputation (one arena, compiler/share_storage.py), so the agreed policy
    # recomputes some of selective's values on both ranks (the smallest reachable is 0.00867
    # MB, 14 of them); clipped (the
    # tables' squares join ZeRO's agreement); nonfinite="skip" with a NaN in step 1 on the
    # last rank (the tables' verdict joins the agreement, their update kept only when every
    # rank's is finite); predict on 11 rows after the ZeRO-3 gather. make test-slow (57 s;
    # stop 71 moved it for time: tables beside ZeRO sharding, clipping and the NaN step run in
    # make test in the dp 2 x tp 2 case below)
    pytest.param("table", "adamw", 2, ("--zero", 3, "--budget", 0.0087, "--clip", 0.1,
                                       "--nan-step", 1, "--predict", 11),
                 marks=pytest.mark.slow),
    # fp16 under ZeRO-2: the pooled bags' exchange in float32 on both sides (AutoCast), the
    # loss scale's overflows (here N ranks' local gradients overflow at 2^16 where one
    # process's do not) and the NaN step skipped through the same guard (make test runs it
    # at dp 2 x tp 2, below)
    pytest.param("table", "adamw", 2, ("--zero", 2, "--precision", "fp16", "--nan-step", 1,
                                       "--steps", 4), marks=pytest.mark.slow),
    # row-wise sparse SGD beside ZeRO-2, clipped, the NaN step skipped by the row updates'
    # keep flag; gradient accumulation beside ZeRO-1
    pytest.param("row", "sgd", 3, ("--zero", 2, "--clip", 0.1, "--nan-step", 1),
                 marks=pytest.mark.slow),
    pytest.param("table", "adamw", 2, ("--zero", 1, "--microbatches", 2),
                 marks=pytest.mark.slow),
    # dp 2 x tp 2: the MLPs split over each dp group's tp ranks, the tables sharded over the
    # dp ranks and whole on every tp rank; ZeRO-2 over dp, fp16 (its overflow skip and the
    # NaN step through ShardZeRO's guard), clipped (the tables' squares over dp, not tp)
    # (predict beside tp, its classes gathered over tp and its lookups over dp: the
    # checkpoint chain across tp in test-slow; here it cost 45 s)
    ("table", "adamw", 4, ("--tp", 2, "--zero", 2, "--precision", "fp16", "--clip", 0.1,
                           "--nan-step", 1, "--steps", 4)),
], ids=["row-sgd-2-sparse-clip", "table-adamw-4-plan-clip", "row-sgd_momentum-4",
        "table-sgd-3-sparse", "table-adamw-2-zero3-skip", "table-adamw-2-zero2-fp16",
        "row-sgd-3-sparse-zero2-skip", "table-adamw-2-zero1-microbatches",
        "table-adamw-dp2xtp2-zero2-fp16"])
def test_sharded_tables_equal_one_process(mode, optimizer, ranks, extra):
    extra, steps = list(extra), 3
    if "--steps" in extra:  # (ep_train.py takes them as its third argument)
        at = extra.index("--steps")
        steps = extra[at + 1]
        del extra[at:at + 2]
    out = check_mpi("ep_train.py", ranks, mode, optimizer, steps, *extra, timeout=420)
    assert ("--nan-step" in extra) == ("skipped on every rank" in out), out[-3000:]
    assert_ranks_ok(out, ranks, "EP OK")
    dp = ranks // dict(zip(extra[::2], extra[1::2])).get("--tp", 1)
    assert f"{mode}-wise over {dp}" in out and "one process vs PyTorch" in out, out
    assert ("--clip" in extra) == ("clipped at" in out), out
    assert ("--predict" in extra) == ("predict on" in out), out
    assert ("--zero" in extra) == (out.count("dense, optimizer state") == ranks), out
    if "--budget" in extra:  # one policy for the dp group, chosen by the largest rank's peaks
        chosen = set(re.findall(r"budget: rank \d+ recompute (.*) planned", out))
        assert len(chosen) == 1 and chosen != {"None"}, (chosen, out[-3000:])


@pytest.mark.slow  # 56 s: make test-slow (stop 71, for time; the full-tensor checkpoint path it
# shares with tensor parallelism round-trips in make test: test_context_parallel's cp x tp)
def test_checkpoint_reshards_table_to_row_to_one_process(tmp_path):
    """Saved table-wise at N=2 (row-wise Adagrad: one accumulator per row, each table's
    looked-up rows and their accumulators updated in place), resumed row-wise at N=3, then by
    one process (the dense update): each continues exactly as one process that never
    stopped, and state_dict() / optimizer_state_dict() are the full tables and (rows, 1)
    accumulators throughout. (AdamW's two parameter-shaped states shard the same way as the
    parameters: table-adamw-4-plan, make test-slow.)"""
    ckpt = tmp_path / "ckpt"
    assert_ranks_ok(check_mpi("ep_train.py", 2, "table", "rowwise_adagrad", 2, "--save", ckpt,
                              timeout=300), 2, "EP OK")
    assert_ranks_ok(check_mpi("ep_train.py", 3, "row", "rowwise_adagrad", 2, "--load", ckpt,
                              "--save", ckpt, timeout=300), 3, "EP OK")
    assert_ranks_ok(check_mpi("ep_train.py", 1, "none", "rowwise_adagrad", 1, "--load", ckpt,
                              timeout=300), 1, "EP OK")


@pytest.mark.slow
def test_checkpoint_reshards_across_tp_beside_the_tables(tmp_path):
    """Saved table-wise at dp 2 x tp 2 (ZeRO-1), resumed row-wise at dp 2 x tp 2 under ZeRO-3
    (each rank's tp piece, then its ZeRO shard of it; the tables' rows), then by one
    process."""
    ckpt = tmp_path / "ckpt"
    out = check_mpi("ep_train.py", 4, "table", "adamw", 2, "--tp", 2, "--zero", 1, "--save",
                    ckpt, "--predict", 11, timeout=400)  # predict: classes over tp, ids over dp
    assert_ranks_ok(out, 4, "EP OK")
    assert "predict on 11 rows" in out, out
    assert_ranks_ok(check_mpi("ep_train.py", 4, "row", "adamw", 1, "--tp", 2, "--zero", 3,
                              "--load", ckpt, "--save", ckpt, timeout=400), 4, "EP OK")
    assert_ranks_ok(check_mpi("ep_train.py", 1, "none", "adamw", 1, "--load", ckpt,
                              timeout=300), 1, "EP OK")


@pytest.mark.slow
def test_checkpoint_reshards_from_zero3_to_zero1_to_one_process(tmp_path):
    """AdamW saved table-wise at N=2 with the dense layers under ZeRO-3, resumed row-wise at
    N=3 under ZeRO-1, then by one process: the files hold full tensors whatever the layout."""
    ckpt = tmp_path / "ckpt"
    assert_ranks_ok(check_mpi("ep_train.py", 2, "table", "adamw", 2, "--zero", 3, "--save",
                              ckpt, timeout=300), 2, "EP OK")
    assert_ranks_ok(check_mpi("ep_train.py", 3, "row", "adamw", 2, "--zero", 1, "--load", ckpt,
                              "--save", ckpt, timeout=300), 3, "EP OK")
    assert_ranks_ok(check_mpi("ep_train.py", 1, "none", "adamw", 1, "--load", ckpt,
                              timeout=300), 1, "EP OK")


@pytest.mark.slow  # 34 s: make test-slow (stop 71, for time; every rank refusing before any
# collective: tests/distributed/test_tensor_parallel.py's world-3 case)
def test_bad_plans_and_ids_are_refused_on_every_rank():
    out = check_mpi("ep_errors.py", 2, timeout=180)
    assert_ranks_ok(out, 2, "EP ERRORS OK")
    for message in ("which is no embedding table", "outside the data-parallel group",
                    "needs dist.get_config().embedding_parallel", "different rows per rank",
                    "([5, 8] rows by rank", "([8, 8] rows by rank, 2 different contents",
                    "asked for row -1"):
        assert out.count(message) == 2, (message, out)
    assert out.count("was asked for row 60") == 1 and out.count("the batch of rank(s) [1]") == 1

"""python -m raf_dist.tools.plan: the ranked meshes for a model and a cluster (one process).
Its validation against measured steps is bench/plan_validation.py (bench/RESULTS.md)."""
import json

import pytest

from raf_dist.tools.plan import Choice, boundary_bytes, main, memory_bytes, plan, rank_key

KEYS = {"dp", "tp", "pp", "zero", "microbatches", "recompute", "step_time_s",
        "memory_per_device_gb", "comm_bytes_per_step"}


@pytest.fixture(scope="module")
def ranked():
    # a count of simulations, not seconds: the same rows on any machine
    return plan("gpt2", 4, 8.0, 8, seq=64, cluster_spec="dgx-a100", budget_s=1e9,
                max_simulations=4)


def test_plan_ranks_simulated_configurations_that_fit_first(ranked):
    assert ranked[0].fits and ranked[0].how == "simulated"
    simulated = [c for c in ranked if c.how == "simulated"]
    assert len(simulated) == 4
    times = [c.step_time_s for c in simulated]
    assert times == sorted(times) and all(t > 0 for t in times)
    shapes = {(c.dp, c.tp, c.pp) for c in ranked}
    assert {(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1)} <= shapes  # every mesh considered
    for c in ranked:
        assert c.dp * c.tp * c.pp == 4 and 8 % (c.dp * c.microbatches) == 0


def test_equal_times_rank_the_smaller_footprint_first():
    def choice(zero, memory, step, how="simulated"):
        return Choice(4, 1, 1, zero, 1, "none", memory, True, step, how=how)

    rows = [choice(1, 2.0, 0.5), choice(3, 1.0, 0.6), choice(2, 1.5, 0.5),
            choice(0, 0.5, 0.1, how="estimated")]
    assert [c.zero for c in sorted(rows, key=rank_key)] == [2, 1, 3, 0]


def test_memory_follows_the_layout_zero_and_recomputation(ranked):
    by = {(c.dp, c.tp, c.pp, c.zero, c.microbatches, c.recompute): c.memory_per_device_gb
          for c in ranked}
    # ZeRO shards the optimizer state (1), the gradients (2), the parameters (3)
    levels = [by[(4, 1, 1, z, 1, "none")] for z in range(4)]
    assert levels == sorted(levels, reverse=True) and levels[0] > levels[3]
    assert by[(4, 1, 1, 0, 1, "full")] < by[(4, 1, 1, 0, 1, "selective")] < by[
        (4, 1, 1, 0, 1, "none")]
    # 12 layers over 4 stages hold a quarter of the parameters each (about)
    assert by[(1, 1, 4, 0, 4, "full")] < by[(4, 1, 1, 0, 1, "full")]


def test_a_pipeline_rank_holds_its_boundary_messages():
    """What tools/plan adds to a pipeline rank's activations for its boundary messages equals
    runtime/stage_budget.py's walk of the Trainer's 1F1B actions (the peak of its boundary
    term) on each rank of 3 stages with 4 microbatches, boundaries of 100 and 10 bytes."""
    from raf_dist.runtime import stage_budget
    from raf_dist.training import pipeline_schedule as ps

    rows = [([], 0, 0, 0, 1, 0), ([], 0, 0, 100, 1, 0), ([], 0, 0, 10, 1, 0)]
    messages = stage_budget.Messages([((100,), "uint8"), ((10,), "uint8")],
                                     {1: ((100,), "uint8"), 2: ((10,), "uint8")})
    for rank, actions in enumerate(ps.rank_actions("1f1b", 3, 4, 1)):
        walked = max(b for _, b in stage_budget.held_timeline(actions, [rank], messages))
        assert boundary_bytes(rows, [0, 1, 2], rank, 4, 3) == walked, rank


def test_a_budget_recomputes_only_the_stages_that_need_it():
    """Under pipelining where no recomputation does not fit, the planner offers what
    activation_memory_budget_mb makes the Trainer choose: each rank raises its stage one
    level at a time until it fits. On GPT-2 (12 layers over 4 stages, 4 or 8 microbatches,
    1.4 GB per device: none 1.54-1.66 GB, selective 1.16-1.21) the first stage, which holds
    the most microbatches, recomputes and the others do not; every level is needed (one
    level less on any stage and its rank does not fit), and the row is extracted per stage."""
    from raf_dist.layout import stage_rank
    from raf_dist.proxies.extract import MeshSpec
    from raf_dist.tools.plan import load_model, stage_info

    limit = 1.4
    ranked = plan("gpt2", 4, limit, 8, seq=64, cluster_spec="dgx-a100", budget_s=1e9,
                  max_simulations=0)
    budget = [c for c in ranked if c.recompute == "budget"]
    assert budget and all(c.pp > 1 and c.fits for c in budget)
    at_rows, _ = load_model("gpt2", 64)
    for c in budget:
        uniform = {r.recompute: r for r in ranked if (r.dp, r.tp, r.pp, r.zero, r.microbatches)
                   == (c.dp, c.tp, c.pp, c.zero, c.microbatches) and not r.stage_recompute}
        assert not uniform["none"].fits and len(set(c.stage_recompute)) > 1
        assert c.memory_per_device_gb <= limit
        piece = at_rows(8 // (c.dp * c.microbatches)).without_values()
        stages = stage_info(piece, c.pp)
        for s, level in enumerate(c.stage_recompute):
            if level == "none":
                continue
            lower = list(c.stage_recompute)
            lower[s] = {"selective": "none", "full": "selective"}[level]
            owner = stage_rank(s, c.pp)
            mine = memory_bytes(piece, MeshSpec(dp=c.dp, pp=c.pp, zero=c.zero,
                                                microbatches=c.microbatches), "fp32", stages,
                                lower)
            assert mine > limit * 2**30, (c, s, owner)
        assert c.activation_memory_budget_mb > 0
    assert budget[0].stage_recompute[0] != "none" and budget[0].stage_recompute[-1] == "none"


def test_configurations_that_do_not_fit_are_marked():
    tight = plan("gpt2", 2, 0.5, 4, seq=64, cluster_spec="dgx-a100", max_simulations=1)
    assert any(not c.fits for c in tight)
    assert all(c.memory_per_device_gb > 0.5 for c in tight if not c.fits)
    assert all(c.how != "simulated" for c in tight if not c.fits)


def test_json_rows_carry_the_design_keys(capsys):
    assert main(["--model", "gpt2", "--devices", "2", "--device-memory-gb", "8",
                 "--global-batch", "4", "--seq", "32", "--budget-s", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and KEYS <= set(rows[0])
    with pytest.raises(SystemExit, match="unknown model"):
        main(["--model", "gpt9", "--devices", "2", "--device-memory-gb", "8",
              "--global-batch", "4"])


def test_a_script_model(tmp_path, capsys):
    script = tmp_path / "mine.py"
    script.write_text(
        "import torch\n"
        "def fn():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),\n"
        "                            torch.nn.Linear(64, 10))\n"
        "    return m, (torch.randn(8, 16),)\n")
    assert main(["--model", f"{script}:fn", "--devices", "2", "--device-memory-gb", "1",
                 "--global-batch", "8", "--cluster", "dgx-a100", "--budget-s", "4"]) == 0
    out = capsys.readouterr().out
    assert "simulated" in out and " 2   1   1" in out

"""layout/parallel.py: the one ParallelLayout (the rank formula over pp x dp x cp x tp, each
axis's groups, the derived predicates) and its one table of refusals, tested row by row.
Pure arithmetic: no MPI."""
import itertools
import re
import types

import pytest

from raf_dist.distributed.config import DistConfig
from raf_dist.layout.parallel import AXES, ParallelLayout
from raf_dist.layout.refusals import REFUSALS, Case, check, check_values


def _layouts(world, **sizes):
    return [ParallelLayout.build(world, r, enable_data_parallel=True, **sizes)
            for r in range(world)]


@pytest.mark.parametrize("pp,dp,cp,tp", [(1, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2),
                                         (2, 1, 3, 2), (3, 2, 2, 1)])
def test_coordinates_follow_the_rank_formula_and_cover_the_mesh_once(pp, dp, cp, tp):
    world = pp * dp * cp * tp
    layouts = _layouts(world, pp=pp, cp=cp, tp=tp)
    coords = []
    for layout in layouts:
        c = (layout.pp_rank, layout.dp_rank, layout.cp_rank, layout.tp_rank)
        assert layout.rank == ((c[0] * dp + c[1]) * cp + c[2]) * tp + c[3]  # DESIGN.md 1
        assert layout.rank_at(*c) == layout.rank
        coords.append(c)
    assert sorted(coords) == list(itertools.product(range(pp), range(dp), range(cp), range(tp)))


@pytest.mark.parametrize("axis", AXES)
def test_each_axis_partitions_the_world_into_groups_with_distinct_colors(axis):
    layouts = _layouts(24, pp=2, cp=3, tp=2)  # dp 2
    groups = {}
    for layout in layouts:
        members = layout.group_ranks(axis)
        assert members[layout.coordinate(axis)] == layout.rank  # its place is its coordinate
        assert len(members) == layout.size(axis)
        groups.setdefault(layout.group_color(axis), set()).add(tuple(members))
    assert all(len(g) == 1 for g in groups.values())  # one color, one group
    seen = sorted(r for g in groups.values() for members in g for r in members)
    assert seen == list(range(24))  # every rank in exactly one group of the axis


def test_group_ranks_world8_pp2_dp2_tp2():
    layout = ParallelLayout.build(8, 5, tp=2, pp=2, enable_data_parallel=True)
    assert (layout.pp_rank, layout.dp_rank, layout.tp_rank) == (1, 0, 1)
    assert layout.group_ranks("tp") == [4, 5]
    assert layout.group_ranks("dp") == [5, 7]
    assert layout.group_ranks("pp") == [1, 5]
    assert layout.group_ranks("cp") == [5]
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        layout.group_ranks("ep")


def test_expert_groups_are_consecutive_dp_ranks():
    layout = ParallelLayout(world=8, rank=6, dp=8, ep=4, enable_data_parallel=True)
    assert (layout.dp_rank, layout.ep_rank) == (6, 2)
    assert layout.expert_group_ranks() == [4, 5, 6, 7]


@pytest.mark.parametrize("kwargs,expected", [
    # (build arguments) -> (data_parallel, grad_world, spmd, zero, sharded_update, params_sharded)
    (dict(world=1), (False, 1, False, 0, False, False)),
    (dict(world=4, enable_data_parallel=True), (True, 4, True, 0, False, False)),
    (dict(world=1, enable_data_parallel=True, zero_level=3), (True, 1, False, 3, True, True)),
    (dict(world=4, enable_data_parallel=True, zero_level=2, tp=2), (True, 2, True, 2, True, False)),
    (dict(world=2, tp=2), (False, 1, True, 0, False, False)),
    (dict(world=2, pp=2, zero_level=1), (False, 1, True, 0, False, False)),
    # context parallelism reduces gradients over cp without data parallelism, over dp x cp
    # with it (ZeRO shards there too)
    (dict(world=2, cp=2), (True, 2, True, 0, False, False)),
    (dict(world=8, cp=2, tp=2, enable_data_parallel=True, zero_level=1),
     (True, 4, True, 1, True, False)),
])
def test_the_derived_predicates(kwargs, expected):
    layout = ParallelLayout.build(**kwargs)
    assert (layout.data_parallel, layout.grad_world, layout.spmd, layout.zero,
            layout.sharded_update, layout.params_sharded) == expected


def test_the_gradient_group_is_dp_x_cp_with_cp_inner():
    """rank = ((pp * dp + d) * cp + c) * tp + t: rank 6 of pp 1 x dp 2 x cp 2 x tp 2 is
    (d 1, c 1, t 0); its gradient group is every (d, c) at t 0, in grad_rank order."""
    layout = ParallelLayout.build(8, 6, tp=2, cp=2, enable_data_parallel=True)
    assert (layout.dp_rank, layout.cp_rank, layout.tp_rank, layout.grad_rank) == (1, 1, 0, 3)
    assert layout.grad_group_ranks() == [0, 2, 4, 6]
    other = ParallelLayout.build(8, 5, tp=2, cp=2, enable_data_parallel=True)
    assert other.grad_color() != layout.grad_color() and other.grad_group_ranks() == [1, 3, 5, 7]


def test_the_layout_is_frozen_and_stages_per_rank_applies_to_interleaved_only():
    layout = ParallelLayout.build(2, 0, pp=2, schedule="1f1b", stages_per_rank=3)
    assert layout.stages_per_rank == 1 and layout.num_stages == 2
    with pytest.raises(AttributeError):
        layout.tp = 2  # type: ignore[misc]
    inter = ParallelLayout.build(2, 0, pp=2, schedule="interleaved_1f1b", stages_per_rank=3)
    assert inter.num_stages == 6


def _model(dropout=(), rows=8):
    return types.SimpleNamespace(dropout_specs=list(dropout), batch_size=rows, source="net")


def _optimizer(row_states=("sum",)):
    return types.SimpleNamespace(row_states=list(row_states))


#: every row of REFUSALS: (config fields, world, model, optimizer) that trigger it, and a
#: phrase of the fix its message names
ROWS = {
    "zero_needs_data_parallel": ({"zero_opt_level": 1}, 1, None, None,
                                 "enable_data_parallel = True"),
    "embeddings_need_data_parallel": ({"embedding_parallel": "row"}, 1, None, None,
                                      "embedding_parallel='none'"),
    "sequence_parallel_needs_tp": ({"sequence_parallel": True}, 1, None, None,
                                   "tensor_parallel_size"),
    "zero_bubble_not_built": ({"pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble"},
                              2, None, None, "'1f1b'"),
    "embeddings_with_pipelining_not_built": (
        {"pipeline_parallel_size": 2, "enable_data_parallel": True, "embedding_parallel": "table"},
        2, None, None, "pipeline_parallel_size=1"),
    "context_parallel_with_embedding_parallel": (
        {"context_parallel_size": 2, "enable_data_parallel": True, "embedding_parallel": "row"},
        4, None, None, "embedding_parallel='none'"),
    "expert_parallel_not_built": ({"expert_parallel_size": 2, "enable_data_parallel": True}, 2,
                                  None, None, "expert_parallel_size=1"),
    "experts_divide_dp": ({"expert_parallel_size": 3, "enable_data_parallel": True}, 4, None,
                          None, "divisor of the dp size"),
    "zero23_with_pipelining": ({"pipeline_parallel_size": 2, "enable_data_parallel": True,
                                "zero_opt_level": 2}, 2, None, None, "zero_opt_level=1"),
    "interleaved_microbatches": ({"pipeline_parallel_size": 2, "num_microbatches": 3,
                                  "pipeline_schedule": "interleaved_1f1b"}, 2, None, None,
                                 "multiple of"),
    "zero3_with_microbatches": ({"enable_data_parallel": True, "zero_opt_level": 3,
                                 "num_microbatches": 2}, 2, None, None, "num_microbatches=1"),
    "pipelined_dropout_not_built": ({"pipeline_parallel_size": 2, "num_microbatches": 2}, 2,
                                    _model(dropout=[((2,), "float32", 0.1)]), None,
                                    "set the dropout rates to 0"),
    "microbatches_divide_rows": ({"pipeline_parallel_size": 2, "num_microbatches": 3}, 2,
                                 _model(rows=8), None, "a multiple of 3 rows"),
    "row_states_with_zero": ({"enable_data_parallel": True, "zero_opt_level": 1}, 2, None,
                             _optimizer(), "zero_opt_level=0"),
    "row_states_with_tp": ({"tensor_parallel_size": 2}, 2, None, _optimizer(),
                           "without tensor parallelism"),
}


def test_every_refusal_has_a_row_test():
    assert sorted(ROWS) == sorted(row.name for row in REFUSALS)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_refusal_raises_its_error_naming_the_fix_and_only_when_it_applies(name):
    fields, world, model, optimizer, fix = ROWS[name]
    row = next(r for r in REFUSALS if r.name == name)
    config = DistConfig()
    for field, value in fields.items():
        setattr(config, field, value)  # each field valid alone (no cross-field check here)
    values = config.as_dict()
    layout = _layout_of(values, world)
    # a "world" row is checked once the layout exists: after the "built" rows, which refuse
    # ep > 1 for now, so it is checked alone here
    kinds = ("world",) if row.kind == "world" else tuple({r.kind for r in REFUSALS})
    with pytest.raises(row.error) as err:
        check(Case(layout, None if layout else values, model, optimizer), kinds)
    assert fix in str(err.value), str(err.value)
    case = Case(layout, None if layout else values, model, optimizer)
    fired = [r.name for r in REFUSALS if r.kind in kinds
             and (r.kind != "world" or layout is not None)
             and (r.kind != "model" or model is not None)
             and (r.kind != "optimizer" or optimizer is not None) and r.applies(case)]
    assert fired[0] == name, fired  # the first row that fires is this one
    if row.kind != "world":  # and the public entry points raise the same
        with pytest.raises(row.error, match=re.escape(str(err.value)[:40])):
            check_values(values)
            ParallelLayout.from_config(values, world).validate(model, optimizer)


def _layout_of(values, world):
    """The case's layout without the table's checks (None where the world does not split)."""
    try:
        return ParallelLayout.build(
            world, 0, tp=values["tensor_parallel_size"], pp=values["pipeline_parallel_size"],
            cp=values["context_parallel_size"], ep=values["expert_parallel_size"],
            enable_data_parallel=values["enable_data_parallel"],
            zero_level=values["zero_opt_level"], microbatches=values["num_microbatches"],
            schedule=values["pipeline_schedule"], sequence_parallel=values["sequence_parallel"],
            embedding_parallel=values["embedding_parallel"])
    except ValueError:
        return None


def test_the_defaults_pass_every_row():
    layout = ParallelLayout.from_config(DistConfig().as_dict(), 1)
    layout.validate(_model(), _optimizer(row_states=()))


def test_a_local_trainer_refuses_parallelism_naming_the_fields():
    values = dict(DistConfig().as_dict(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"local=True.*tensor_parallel_size=2"):
        ParallelLayout.from_config(values, 4, local=True)
    assert ParallelLayout.from_config(DistConfig().as_dict(), 4, 3, local=True).world == 1


def test_the_config_and_the_proxies_use_the_same_table():
    """DistConfig.check raises the "config" rows, check_supported the "built" rows and the
    proxies' MeshSpec every row: the same messages everywhere."""
    from raf_dist.proxies.extract import MeshSpec

    config = DistConfig()
    config.zero_opt_level = 1
    with pytest.raises(ValueError, match="requires enable_data_parallel=True"):
        config.check()
    config.reset().update({"expert_parallel_size": 2})  # valid fields, not built
    with pytest.raises(NotImplementedError, match="expert_parallel_size=2 is not built"):
        config.check_supported()
    with pytest.raises(ValueError, match="zero_opt_level=2 with pipeline_parallel_size=2"):
        MeshSpec(dp=2, pp=2, zero=2)
    with pytest.raises(ValueError, match="num_microbatches=2 with zero_opt_level=3"):
        MeshSpec(dp=2, zero=3, microbatches=2)
    with pytest.raises(NotImplementedError, match="with pipeline_parallel_size=2 is not built"):
        MeshSpec(dp=2, pp=2, embedding_parallel="table")

"""Every refusal of a combination of parallelism settings, as one table (``REFUSALS``):
each row names when it applies, the error it raises and a message naming the problem and the
fix. ``ParallelLayout.validate`` (layout/parallel.py), ``DistConfig.check`` /
``check_supported``, the proxies' ``MeshSpec`` and the planner all read this table, so a user
meets the same refusal, worded the same, wherever a combination is decided. Tested row by
row in tests/unit/test_parallel_layout.py. Pure: no MPI."""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple


class Case(NamedTuple):
    """What a row is checked against: a layout (world known), or a config's values alone
    (``DistConfig.check``), and the model when there is one."""

    layout: Any  # a ParallelLayout (layout/parallel.py, which imports this module)
    values: Optional[Mapping[str, Any]]
    model: Any
    optimizer: Any = None

    def get(self, field: str) -> Any:
        """A DistConfig field's value, whichever the case holds."""
        if self.values is not None:
            return self.values.get(field, _DEFAULTS.get(field))
        assert self.layout is not None
        return getattr(self.layout, CONFIG_FIELDS[field])


#: the DistConfig fields a ParallelLayout holds, by the layout's name for each (the one map
#: ``ParallelLayout.from_config`` reads the values through and a row reads a layout through;
#: a layout's ``stages_per_rank`` is 1 outside interleaved_1f1b, whatever the config says)
CONFIG_FIELDS = {
    "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp",
    "context_parallel_size": "cp", "expert_parallel_size": "ep",
    "enable_data_parallel": "enable_data_parallel", "zero_opt_level": "zero_level",
    "num_microbatches": "microbatches", "pipeline_schedule": "schedule",
    "pipeline_stages_per_rank": "stages_per_rank", "sequence_parallel": "sequence_parallel",
    "context_parallel_method": "context_parallel_method",
    "embedding_parallel": "embedding_parallel"}
_DEFAULTS = {"context_parallel_size": 1, "expert_parallel_size": 1, "sequence_parallel": False}


class Refusal(NamedTuple):
    """One row: ``applies(case)`` says the combination is refused; ``error`` is raised with
    ``message(case)``. ``kind``: "config" (a ValueError of the fields alone, checked on every
    ``DistConfig.update``), "built" (not built yet: NotImplementedError, checked by
    ``DistConfig.check_supported``), "layout" (the fields alone, checked when a Trainer builds
    its layout), "world" (needs the world size), "model" (needs the model), "optimizer"
    (needs the optimizer)."""

    name: str
    kind: str
    error: type
    applies: Callable[[Case], bool]
    message: Callable[[Case], str]


def _pp(c: Case) -> int:
    return int(c.get("pipeline_parallel_size"))


def _micro(c: Case) -> int:
    return int(c.get("num_microbatches"))


REFUSALS: Tuple[Refusal, ...] = (
    Refusal("zero_needs_data_parallel", "config", ValueError,
            lambda c: c.get("zero_opt_level") > 0 and not c.get("enable_data_parallel"),
            lambda c: f"zero_opt_level={c.get('zero_opt_level')} shards state across "
            "data-parallel ranks, so it requires enable_data_parallel=True; set "
            "dist.get_config().enable_data_parallel = True or use zero_opt_level=0"),
    Refusal("embeddings_need_data_parallel", "config", ValueError,
            lambda c: c.get("embedding_parallel") != "none" and not c.get("enable_data_parallel"),
            lambda c: f"embedding_parallel={c.get('embedding_parallel')!r} shards the tables "
            "over the data-parallel ranks, so it requires enable_data_parallel=True; set "
            "dist.get_config().enable_data_parallel = True or embedding_parallel='none'"),
    Refusal("sequence_parallel_needs_tp", "config", ValueError,
            lambda c: bool(c.get("sequence_parallel")) and c.get("tensor_parallel_size") == 1,
            lambda c: "sequence_parallel splits the sequence over the tensor-parallel ranks, so "
            "it needs tensor_parallel_size > 1; set dist.get_config().tensor_parallel_size or "
            "sequence_parallel = False"),
    Refusal("zero_bubble_not_built", "built", NotImplementedError,
            lambda c: c.get("pipeline_schedule") == "zero_bubble" and _pp(c) > 1,
            lambda c: "pipeline_schedule='zero_bubble' is not built yet (it needs the backward "
            "split into input and weight gradients); use 'interleaved_1f1b', '1f1b' or 'gpipe'"),
    Refusal("embeddings_with_pipelining_not_built", "built", NotImplementedError,
            lambda c: c.get("embedding_parallel") != "none" and _pp(c) != 1,
            lambda c: f"embedding_parallel={c.get('embedding_parallel')!r} with "
            f"pipeline_parallel_size={_pp(c)} is not built yet (the sharded tables' gradients "
            "and state sit outside the pipeline stages); use pipeline_parallel_size=1 with "
            "sharded tables, or embedding_parallel='none'"),
    Refusal("context_parallel_with_embedding_parallel", "layout", ValueError,
            lambda c: c.get("context_parallel_size") > 1 and c.get("embedding_parallel") != "none",
            lambda c: f"embedding_parallel={c.get('embedding_parallel')!r} shards recommender "
            f"tables over the dp ranks, and context_parallel_size="
            f"{c.get('context_parallel_size')} splits a sequence over ranks; the two are not "
            "combined: use embedding_parallel='none' with context parallelism"),
    Refusal("expert_parallel_not_built", "built", NotImplementedError,
            lambda c: c.get("expert_parallel_size") > 1,
            lambda c: f"expert_parallel_size={c.get('expert_parallel_size')} is not built yet "
            "(experts over the dp ranks by all-to-all come with the mixture-of-experts work); "
            "use expert_parallel_size=1"),
    Refusal("experts_divide_dp", "world", ValueError,
            lambda c: c.layout is not None and c.layout.dp % c.layout.ep != 0,
            lambda c: f"expert_parallel_size={c.get('expert_parallel_size')} must divide the "
            f"data-parallel size ({c.layout.dp if c.layout else '?'}): an expert group is ep "
            "consecutive dp ranks. Choose a divisor of the dp size"),
    Refusal("zero23_with_pipelining", "layout", ValueError,
            lambda c: _pp(c) > 1 and c.get("zero_opt_level") > 1,
            lambda c: f"zero_opt_level={c.get('zero_opt_level')} with pipeline_parallel_size="
            f"{_pp(c)} is not supported: ZeRO-2/3 reduce-scatter gradients (and gather "
            "parameters) per microbatch, which pipelining would repeat M times per step "
            "(DeepSpeed refuses the combination too). Use zero_opt_level=1 (optimizer state "
            "sharded) or 0"),
    Refusal("interleaved_microbatches", "layout", ValueError,
            lambda c: (_pp(c) > 1 and c.get("pipeline_schedule") == "interleaved_1f1b"
                       and _micro(c) % _pp(c) != 0),
            lambda c: "interleaved_1f1b needs num_microbatches to be a multiple of "
            f"pipeline_parallel_size={_pp(c)}, got {_micro(c)}"),
    Refusal("zero3_with_microbatches", "layout", ValueError,
            lambda c: (_pp(c) == 1 and _micro(c) > 1 and c.get("zero_opt_level") == 3
                       and bool(c.get("enable_data_parallel"))),
            lambda c: f"num_microbatches={_micro(c)} with zero_opt_level=3 is not supported: "
            "the microbatches before the last would need the parameters gathered again each "
            "time. Use zero_opt_level <= 2 or num_microbatches=1"),
    Refusal("pipelined_dropout_not_built", "model", NotImplementedError,
            lambda c: _pp(c) > 1 and bool(c.model.dropout_specs),
            lambda c: f"{c.model.source}: pipelining a model with dropout is not supported yet "
            "(the masks would have to follow the stages); set the dropout rates to 0"),
    Refusal("microbatches_divide_rows", "model", ValueError,
            lambda c: _pp(c) > 1 and (c.model.batch_size is None
                                      or c.model.batch_size % _micro(c) != 0),
            lambda c: f"{c.model.source} was captured with {c.model.batch_size} rows per "
            f"data-parallel rank, which num_microbatches={_micro(c)} does not divide into "
            f"equal microbatches; capture it with a multiple of {_micro(c)} rows"),
)

def _row_states(c: Case) -> str:
    return f"{type(c.optimizer).__name__} keeps {list(c.optimizer.row_states)} one value per row"


REFUSALS += (
    Refusal("row_states_with_zero", "optimizer", NotImplementedError,
            lambda c: (bool(c.optimizer.row_states) and not _local(c)
                       and bool(c.get("enable_data_parallel")) and c.get("zero_opt_level") > 0),
            lambda c: f"{_row_states(c)}, and zero_opt_level={c.get('zero_opt_level')} shards "
            "each parameter's flat elements wherever a shard ends (a row can straddle two "
            f"ranks): use zero_opt_level=0 with {type(c.optimizer).__name__} "
            "(embedding_parallel shards the tables and their rows' state), or an optimizer "
            "whose state is shaped like its parameter (SGD, Adagrad, Adam, AdamW)"),
    Refusal("row_states_with_tp", "optimizer", NotImplementedError,
            lambda c: (bool(c.optimizer.row_states) and not _local(c)
                       and c.get("tensor_parallel_size") > 1),
            lambda c: f"{_row_states(c)}, and tensor_parallel_size="
            f"{c.get('tensor_parallel_size')} splits weights along their columns too (each "
            f"rank would see part of a row): use {type(c.optimizer).__name__} without tensor "
            "parallelism, or an optimizer whose state is shaped like its parameter"),
)


def _local(c: Case) -> bool:
    return c.layout is not None and c.layout.local


#: what a ``local=True`` Trainer may not ask for (it joins no collective)
LOCAL_ALONE = {"enable_data_parallel": False, "zero_opt_level": 0, "tensor_parallel_size": 1,
               "pipeline_parallel_size": 1, "embedding_parallel": "none",
               "context_parallel_size": 1, "expert_parallel_size": 1}


def check(case: Case,
          kinds: Tuple[str, ...] = ("config", "built", "layout", "world", "model",
                                    "optimizer")) -> None:
    """Raise the first row of ``REFUSALS`` of ``kinds`` that applies to ``case`` (rows of
    kind "world" need a layout, rows of kind "model" a model)."""
    for row in REFUSALS:
        if row.kind not in kinds or (row.kind == "world" and case.layout is None):
            continue
        if (row.kind == "model" and case.model is None) or (
                row.kind == "optimizer" and case.optimizer is None):
            continue
        if row.applies(case):
            raise row.error(row.message(case))


def check_values(values: Mapping[str, Any], local: bool = False,
                 kinds: Tuple[str, ...] = ("config", "built", "layout"),
                 optimizer: Any = None, model: Any = None) -> None:
    """The rows that a config's values decide alone (``DistConfig.check`` asks for
    ``("config",)``, ``check_supported`` for ``("built",)``), and the rows of ``model`` and
    ``optimizer`` when given (none needs the world: the Trainer checks them before the mesh's
    sizes); with ``local``, after the fields' own rules, that a Trainer of this rank alone
    asks for no parallelism."""
    case = Case(None, values, model, optimizer)
    fields_alone = ("config", "built")
    check(case, tuple(k for k in kinds if k in fields_alone))
    if local:
        asked = {k: values.get(k, v) for k, v in LOCAL_ALONE.items() if values.get(k, v) != v}
        if asked:
            raise ValueError(
                f"Trainer(local=True) builds a Trainer of this rank alone, but the config asks "
                f"for parallelism ({', '.join(f'{k}={v!r}' for k, v in asked.items())}). "
                "Reset those fields (dist.get_config().update(...)) for the local Trainer, or "
                "build it on every rank without local=True")
    rest = tuple(k for k in kinds if k not in fields_alone)
    if not local:  # the model's and the optimizer's rows need no world either
        rest += ("model", "optimizer")
    check(case, rest)

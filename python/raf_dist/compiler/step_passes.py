"""Which raf_dist passes a compiled function goes through, from explicit arguments (the
executors decide them once from the run's plan; no pass reads the config)."""
from ..passes import (AllReduceGradients, DispatchToBLAS, FastExp, FastGelu, MaxPoolGradient,
                      ShardZeRO, StripGradientMarkers)
from ..passes.auto_cast import AccumulateInFloat32
from ..passes.context_parallel import LowerContextParallel
from ..passes.sequence_parallel import LowerSequenceParallel
from ..passes.embedding_parallel import LowerEmbeddingExchange
from ..passes.lookup_gradient import AddLookupGradient
from ..passes.lower_allreduce import LowerAllReduce
from ..passes.propagate_nan import PropagateNaN
from ..passes.tp_ops import LowerTensorParallel
from ..passes.widen_at_use import WidenAtUse


def nonfinite_guard(zero_level: int, world_size: int, nonfinite: str = "raise"):
    """What a step checks for non-finite values before it updates (training/nonfinite.py):
    the reduced gradients (the same on every rank) under data parallelism, the loss too on one
    process; nothing under ZeRO (each bucket is updated as soon as it is reduced)."""
    if zero_level > 0:  # the ZeRO pass guards its own updates (nonfinite="skip" only)
        return None
    return "gradients" if world_size > 1 else "gradients_and_loss"


def step_passes(zero_level: int, world_size: int, bucket_bytes: int, overlap: bool = True,
                group: int = 0, guard: bool = False, tp_group=None, sync_batch_norm_group=None,
                clip=None, embedding_group=None, cp_group=None, sp_group=None):
    """The raf_dist passes a training step goes through (before TVM's lowering): the
    distribution pass for the ZeRO level (0: data parallel allreduce; world size 1 at level 0:
    none), then the lowering of tensor-parallel ops (``tp_group``) and of synchronized batch
    norm's allreduces (``sync_batch_norm_group``), library dispatch and fast math. ``guard``:
    under ZeRO, no update unless every rank's gradients are finite (nonfinite="skip";
    passes/zero.py); ``clip`` (a passes.clipping.Clip): under ZeRO, the gradient shards clipped
    by the global norm (without ZeRO the step builder clips). ``embedding_group``: the
    tables are sharded over that (dp) group: their exchanges become all-to-alls and the
    non-finite verdict an allreduce there (passes/embedding_parallel.py). ``cp_group``: the
    sequence is split over that group: its attention and positions become host calls on it
    (passes/context_parallel.py). ``sp_group``: sequence parallelism's scatters and gathers
    on that (tp) group (passes/sequence_parallel.py)."""
    if zero_level:
        distribute = ShardZeRO(zero_level, world_size, bucket_bytes, overlap=overlap, group=group,
                               guard=guard, clip=clip)
    elif world_size > 1:
        distribute = AllReduceGradients(world_size, bucket_bytes, overlap=overlap, group=group)
    else:
        distribute = StripGradientMarkers()
    lowering = []
    if tp_group is not None:  # f and g (passes/tp_ops.py), after autodiff
        lowering.append(LowerTensorParallel(tp_group))
    if embedding_group is not None:  # the tables' exchanges (passes/embedding_parallel.py)
        lowering.append(LowerEmbeddingExchange(embedding_group))
    if cp_group is not None:  # ring / all-to-all attention (passes/context_parallel.py)
        lowering.append(LowerContextParallel(cp_group))
    if sp_group is not None:  # before tp's: the sp ops' gradients hold f
        lowering.insert(0, LowerSequenceParallel(sp_group))
    if sync_batch_norm_group is not None or embedding_group is not None:
        # synchronized batch norm's statistics, the sharded tables' non-finite verdict
        lowering.append(LowerAllReduce(sync_batch_norm_group if sync_batch_norm_group
                                       is not None else embedding_group))
    return [distribute, *lowering, *function_passes()]


def function_passes():
    """The passes of any compiled function after its collectives are in place."""
    return [AddLookupGradient(), PropagateNaN(), DispatchToBLAS(), AccumulateInFloat32(),
            FastGelu(), FastExp(), MaxPoolGradient(), WidenAtUse()]


def forward_passes(tp_group=None, embedding_group=None, cp_group=None, sp_group=None):
    """The passes of an evaluation forward (``predict``)."""
    return ([LowerSequenceParallel(sp_group)] if sp_group is not None else []) + (
        [LowerTensorParallel(tp_group)] if tp_group is not None else []) + (
        [LowerEmbeddingExchange(embedding_group)] if embedding_group is not None else []) + (
        [LowerContextParallel(cp_group)] if cp_group is not None else []) + [
        PropagateNaN(), DispatchToBLAS(), AccumulateInFloat32()]

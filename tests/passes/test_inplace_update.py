"""UpdateInPlace: after compilation every new parameter and optimizer state is written into the
argument buffer it replaces (no fresh allocation), at every ZeRO level and world size; the pass
refuses, keeping the allocation, when the argument is read after its update or read at other
elements than the kernel writes; and the planned memory no longer holds a second copy."""
import logging

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import tirx as T

import raf_dist
from models import make, raf_optimizer
from raf_dist.compiler.build import lower_and_plan
from raf_dist.compiler.inplace_update import UpdateInPlace
from raf_dist.compiler.step_passes import step_passes
from raf_dist.training import build_train_step

UPDATED = "raf_dist.updated_arguments"


def _output_roots(func):
    """What each output field of the planned ``func`` is, following variable aliases and
    tuple items to the binding that defines its memory: a function parameter, or the call
    that allocated it."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}

    def root(expr):
        while True:
            if isinstance(expr, relax.Var) and expr in bound:
                expr = bound[expr]
            elif isinstance(expr, relax.TupleGetItem):
                tup = bound.get(expr.tuple_value, expr.tuple_value)
                expr = tup.fields[expr.index]
            else:
                return expr

    return [root(f) for f in root(func.body.body).fields]


def _planned(model_name, optimizer, level, world_size, bucket_bytes):
    module, x, _ = make(model_name, 4)
    mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                              raf_optimizer(optimizer))
    with tvm.transform.PassContext(opt_level=3):
        for p in step_passes(level, world_size, bucket_bytes):
            mod = p(mod)
    return lower_and_plan(mod, tvm.target.Target("llvm"))["train_step"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum", "adam"])
@pytest.mark.parametrize("level, world_size", [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4)])
@pytest.mark.parametrize("model_name, bucket_bytes", [("mlp", 1000), ("transformer", 4000)])
def test_every_new_parameter_and_state_is_its_argument(model_name, bucket_bytes, level,
                                                       world_size, optimizer):
    func = _planned(model_name, optimizer, level, world_size, bucket_bytes)
    updated = [int(i) for i in func.attrs[UPDATED]]
    roots = _output_roots(func)[1:]
    assert len(roots) == len(updated) > 0
    for root, index in zip(roots, updated):
        assert root.same_as(func.params[index]), (func.params[index].name, root)


def test_cnn_states_at_level_2_uneven_shards():
    func = _planned("cnn", "adamw", 2, 3, 500)
    for root, index in zip(_output_roots(func)[1:], func.attrs[UPDATED]):
        assert root.same_as(func.params[int(index)]), func.params[int(index)].name


# Kernels of lowered (after CallTIRRewrite) steps built by hand: out = f(p).
@I.ir_module
class Kernels:
    @T.prim_func(private=True, s_tir=True)
    def halve(p: T.Buffer((T.int64(4),), "float32"), out: T.Buffer((T.int64(4),), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in range(T.int64(4)):
            with T.sblock("out"):
                v = T.axis.spatial(T.int64(4), i)
                T.reads(p[v])
                T.writes(out[v])
                out[v] = p[v] * T.float32(0.5)

    @T.prim_func(private=True, s_tir=True)
    def reverse(p: T.Buffer((T.int64(4),), "float32"), out: T.Buffer((T.int64(4),), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in range(T.int64(4)):
            with T.sblock("out"):
                v = T.axis.spatial(T.int64(4), i)
                T.reads(p[T.int64(3) - v])
                T.writes(out[v])
                out[v] = p[T.int64(3) - v]


def _lowered_step(kernel, read_after):
    """train_step(loss, p) -> (loss, new p): new p = kernel(p) into a fresh allocation; with
    ``read_after``, a second kernel reads p after that."""
    mod = Kernels.clone()
    ty = relax.TensorType((4,), "float32")
    loss, p = relax.Var("loss", relax.TensorType((), "float32")), relax.Var("p", ty)
    bb = relax.BlockBuilder(mod)
    with bb.function("train_step", [loss, p], attrs={UPDATED: [1]}, pure=False):
        def alloc():
            return bb.emit(relax.op.builtin.alloc_tensor(relax.ShapeExpr([4]), "float32",
                                                         relax.prim_value(0)))
        new = alloc()
        bb.emit(relax.Call(mod.get_global_var(kernel), [p, new]))
        if read_after:
            bb.emit(relax.Call(mod.get_global_var(kernel), [p, alloc()]))
        bb.emit_func_output(bb.emit(relax.Tuple([loss, new])))
    return bb.get()


@pytest.mark.parametrize("kernel, read_after, in_place", [
    ("halve", False, True), ("reverse", False, False), ("halve", True, False)])
def test_in_place_only_when_safe(kernel, read_after, in_place, caplog):
    with caplog.at_level(logging.WARNING, logger="raf_dist"):
        out = UpdateInPlace()(_lowered_step(kernel, read_after))
    func = out["train_step"]
    assert _output_roots(func)[1].same_as(func.params[1]) == in_place
    refused = [r.getMessage() for r in caplog.records if "UpdateInPlace" in r.getMessage()]
    assert bool(refused) != in_place, refused
    if in_place:  # the kernel now reads and writes one buffer: it must not promise noalias
        callee = [b.value.op for b in func.body.blocks[0].bindings
                  if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.GlobalVar)]
        assert callee and "tirx.noalias" not in (out[callee[0]].attrs or {})
    else:
        assert "reads" in refused[0], refused


def test_planned_memory_holds_no_second_copy():
    """wide_mlp, AdamW, one process (parameters dominate): before, the planned temporaries
    held the new parameters and both new states (3 x param_bytes) besides the gradients;
    now they hold the gradients (param_bytes), activations and a few small buffers."""
    module, x, _ = make("wide_mlp", 4)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    est = raf_dist.estimate_memory(model, raf_optimizer("adamw"), 1, 0)
    assert est["planned_peak_bytes"] < 1.5 * est["param_bytes"], est

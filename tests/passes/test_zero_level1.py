"""IR tier for ShardZeRO at level 1 (ZeRO-1): TVMScript Before / Expected, structural equality.

Level 1 keeps parameters and gradients whole, shards the optimizer state (one flat [S] shard
per gradient bucket and state, bucket-major) and reduce-scatters every gradient bucket only
once backward has ended; each rank updates its shard and the updated shards are all-gathered
straight into the parameter arguments. Pinned here: the order (every reduce_scatter after the
last gradient), the bucket-major state arguments and outputs, the overlapped variant (one
reduce_scatter kept in flight while the previous bucket is updated and gathered), and the
non-finite guard (every update waits for the agreed verdict and becomes a select), and two
states per parameter with a forward-written buffer (bucket-major states, the buffer's argument
index renumbered). No MPI."""
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes import ShardZeRO


# w1: 3 elements, w2: 1 element, N = 2 ranks: shards of ceil(3/2) = 2 and ceil(1/2) = 1
# elements. Momentum SGD: one state per parameter. Backward produces w2's gradient first.
@I.ir_module
class Before:
    @R.function
    def train_step(x: R.Tensor((3,), "float32"), w1: R.Tensor((3,), "float32"),
                   w2: R.Tensor((1,), "float32"), w1_buf: R.Tensor((3,), "float32"),
                   w2_buf: R.Tensor((1,), "float32"), lr: R.Tensor((), "float32")):
        R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 2,
                     "raf_dist.states_per_param": 1})
        with R.dataflow():
            y = R.multiply(x, w1)
            loss = R.sum(R.multiply(y, w2))
            g2 = R.sum(y, axis=[0], keepdims=True)
            m2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                    ty_args=R.Tensor((1,), "float32"))
            g1 = R.multiply(x, w2)
            m1 = R.call_pure_packed("raf_dist.mark_gradient", g1, R.prim_value(0),
                                    ty_args=R.Tensor((3,), "float32"))
            b1 = R.add(R.multiply(w1_buf, R.const(0.9, "float32")), m1)
            new_w1 = R.subtract(w1, R.multiply(b1, lr))
            b2 = R.add(R.multiply(w2_buf, R.const(0.9, "float32")), m2)
            new_w2 = R.subtract(w2, R.multiply(b2, lr))
            out = (loss, new_w1, new_w2, b1, b2)
            R.output(out)
        return out


# One bucket (1000 bytes hold both gradients), no overlap. Backward runs to its end (g1, the
# last gradient, before any collective); one blocking reduce_scatter (avg) then reads both
# gradients where they are and leaves this rank's [S] = [1 + 2] shards; local_shard cuts the
# matching shard of (w2, w1) at run time; w2's momentum chain runs once on the bucket's flat
# shards (bucket0__state0 replaces both w1_buf and w2_buf); the allgather writes the updated
# shards into w2 and w1 themselves, which the step returns; the loss is averaged.
@I.ir_module
class ExpectedOneBucketSerial:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((3,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((3,), dtype="float32"), lr: R.Tensor((), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 1, "raf_dist.updated_arguments": [1, 2, 3], "raf_dist.zero_level": 1})
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, w1)
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(y, w2)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, w2)
            grad_shard0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            R.output(loss, g2, g1, grad_shard0)
        R.call_packed("raf_dist.ccl.reduce_scatter", g2, g1, R.str("avg"), 0, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shard0 = R.call_dps_packed("raf_dist.ccl.local_shard", (w2, w1, 0), out_ty=R.Tensor((3,), dtype="float32"))
            lv11_b0: R.Tensor((3,), dtype="float32") = R.multiply(bucket0__state0, R.const(0.9, "float32"))
            b2_b0: R.Tensor((3,), dtype="float32") = R.add(lv11_b0, grad_shard0)
            lv13_b0: R.Tensor((3,), dtype="float32") = R.multiply(b2_b0, lr)
            new_w2_b0: R.Tensor((3,), dtype="float32") = R.subtract(param_shard0, lv13_b0)
            R.output(b2_b0, new_w2_b0)
        R.call_packed("raf_dist.ccl.allgather", new_w2_b0, 0, w2, w1, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")) = loss, w1, w2, b2_b0
        return step_outputs


# Two buckets (4 bytes close a bucket after each gradient: [w2], then [w1]), overlap on, group
# 5. Still nothing before backward's end (level 1, unlike level 2). Both reduce_scatters are
# started; bucket 0 is waited on, updated and its allgather started while bucket 1's
# reduce_scatter is in flight; then bucket 1; the gathers are waited on last. The optimizer
# state arguments become one [S_b] shard per bucket, bucket-major (bucket0 = w2's [1],
# bucket1 = w1's [2]), and so do the state outputs.
@I.ir_module
class ExpectedTwoBucketsOverlap:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((3,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((1,), dtype="float32"), bucket1__state0: R.Tensor((2,), dtype="float32"), lr: R.Tensor((), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((2,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 1, "raf_dist.updated_arguments": [1, 2, 3, 4], "raf_dist.zero_level": 1})
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, w1)
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(y, w2)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, w2)
            grad_shard0: R.Tensor((1,), dtype="float32") = R.builtin.alloc_tensor(R.shape([1]), R.dtype("float32"), 0, R.str("global"))
            R.output(loss, g2, g1, grad_shard0)
        reduce_scatter0_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.reduce_scatter_start", g2, R.str("avg"), 5, grad_shard0, ty_args=R.Prim("int64"))
        with R.dataflow():
            grad_shard1: R.Tensor((2,), dtype="float32") = R.builtin.alloc_tensor(R.shape([2]), R.dtype("float32"), 0, R.str("global"))
            R.output(grad_shard1)
        reduce_scatter1_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.reduce_scatter_start", g1, R.str("avg"), 5, grad_shard1, ty_args=R.Prim("int64"))
        R.call_packed("raf_dist.ccl.wait", reduce_scatter0_handle, g2, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shard0 = R.call_dps_packed("raf_dist.ccl.local_shard", (w2, 5), out_ty=R.Tensor((1,), dtype="float32"))
            lv11_b0: R.Tensor((1,), dtype="float32") = R.multiply(bucket0__state0, R.const(0.9, "float32"))
            b2_b0: R.Tensor((1,), dtype="float32") = R.add(lv11_b0, grad_shard0)
            lv13_b0: R.Tensor((1,), dtype="float32") = R.multiply(b2_b0, lr)
            new_w2_b0: R.Tensor((1,), dtype="float32") = R.subtract(param_shard0, lv13_b0)
            R.output(b2_b0, new_w2_b0)
        allgather_updated0_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.allgather_start", new_w2_b0, 5, w2, ty_args=R.Prim("int64"))
        R.call_packed("raf_dist.ccl.wait", reduce_scatter1_handle, g1, grad_shard1, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shard1 = R.call_dps_packed("raf_dist.ccl.local_shard", (w1, 5), out_ty=R.Tensor((2,), dtype="float32"))
            lv7_b1: R.Tensor((2,), dtype="float32") = R.multiply(bucket1__state0, R.const(0.9, "float32"))
            b1_b1: R.Tensor((2,), dtype="float32") = R.add(lv7_b1, grad_shard1)
            lv9_b1: R.Tensor((2,), dtype="float32") = R.multiply(b1_b1, lr)
            new_w1_b1: R.Tensor((2,), dtype="float32") = R.subtract(param_shard1, lv9_b1)
            R.output(b1_b1, new_w1_b1)
        allgather_updated1_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.allgather_start", new_w1_b1, 5, w1, ty_args=R.Prim("int64"))
        R.call_packed("raf_dist.ccl.wait", allgather_updated0_handle, new_w2_b0, w2, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.wait", allgather_updated1_handle, new_w1_b1, w1, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 5, loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((2,), dtype="float32")) = loss, w1, w2, b2_b0, b1_b1
        return step_outputs


# guard=True (Trainer(nonfinite="skip")): after the reduce_scatter each rank checks its loss
# and its gradient shards, the ranks sum their "not finite" flags (one allreduce), and the
# update of parameters and states becomes a select between new and old values, the loss NaN
# when any rank saw a non-finite value; the allgather then writes the kept shards.
@I.ir_module
class ExpectedGuarded:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((3,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((3,), dtype="float32"), lr: R.Tensor((), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 1, "raf_dist.updated_arguments": [1, 2, 3], "raf_dist.zero_level": 1})
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, w1)
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(y, w2)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, w2)
            grad_shard0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            R.output(loss, g2, g1, grad_shard0)
        R.call_packed("raf_dist.ccl.reduce_scatter", g2, g1, R.str("avg"), 0, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            loss_finite: R.Tensor((), dtype="bool") = R.isfinite(loss)
            shard_sum0: R.Tensor((), dtype="float32") = R.sum(grad_shard0, axis=None, keepdims=False)
            shard_finite0: R.Tensor((), dtype="bool") = R.isfinite(shard_sum0)
            finite0: R.Tensor((), dtype="bool") = R.logical_and(loss_finite, shard_finite0)
            not_finite: R.Tensor((), dtype="float32") = R.where(finite0, R.const(0.0, "float32"), R.const(1.0, "float32"))
            not_finite_1: R.Tensor((1,), dtype="float32") = R.reshape(not_finite, R.shape([1]))
            not_finite_total: R.Tensor((1,), dtype="float32") = R.builtin.alloc_tensor(R.shape([1]), R.dtype("float32"), 0, R.str("global"))
            R.output(not_finite_1, not_finite_total)
        R.call_packed("raf_dist.ccl.allreduce", not_finite_1, R.str("sum"), 0, not_finite_total, ty_args=(R.Tuple,))
        with R.dataflow():
            not_finite_all: R.Tensor((), dtype="float32") = R.reshape(not_finite_total, R.shape([]))
            all_finite: R.Tensor((), dtype="bool") = R.less(not_finite_all, R.const(0.5, "float32"))
            guarded_loss: R.Tensor((), dtype="float32") = R.where(all_finite, loss, R.const(float("nan"), "float32"))
            param_shard0 = R.call_dps_packed("raf_dist.ccl.local_shard", (w2, w1, 0), out_ty=R.Tensor((3,), dtype="float32"))
            lv11_b0: R.Tensor((3,), dtype="float32") = R.multiply(bucket0__state0, R.const(0.9, "float32"))
            b2_b0: R.Tensor((3,), dtype="float32") = R.add(lv11_b0, grad_shard0)
            lv13_b0: R.Tensor((3,), dtype="float32") = R.multiply(b2_b0, lr)
            new_w2_b0: R.Tensor((3,), dtype="float32") = R.subtract(param_shard0, lv13_b0)
            kept_param0: R.Tensor((3,), dtype="float32") = R.where(all_finite, new_w2_b0, param_shard0)
            kept_state0_0: R.Tensor((3,), dtype="float32") = R.where(all_finite, b2_b0, bucket0__state0)
            R.output(guarded_loss, kept_param0, kept_state0_0)
        R.call_packed("raf_dist.ccl.allgather", kept_param0, 0, w2, w1, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.allreduce", guarded_loss, R.str("avg"), 0, guarded_loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")) = guarded_loss, w1, w2, kept_state0_0
        return step_outputs


# Two states per parameter (an Adam-like rule) and a buffer the forward writes (a BatchNorm
# running statistic, the last argument and the last output): one bucket, so the four state
# arguments become two flat [S] shards (state0 then state1) and the buffer, passed through
# replicated, moves from argument 8 to argument 6 in updated_arguments.
@I.ir_module
class BeforeTwoStatesAndBuffer:
    @R.function
    def train_step(x: R.Tensor((3,), "float32"), w1: R.Tensor((3,), "float32"),
                   w2: R.Tensor((1,), "float32"), m1: R.Tensor((3,), "float32"),
                   v1: R.Tensor((3,), "float32"), m2: R.Tensor((1,), "float32"),
                   v2: R.Tensor((1,), "float32"), lr: R.Tensor((), "float32"),
                   run: R.Tensor((3,), "float32")):
        R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 2,
                     "raf_dist.states_per_param": 2,
                     "raf_dist.updated_arguments": [1, 2, 3, 4, 5, 6, 8]})
        with R.dataflow():
            y = R.multiply(x, w1)
            new_run = R.add(run, y)
            loss = R.sum(R.multiply(y, w2))
            g2 = R.sum(y, axis=[0], keepdims=True)
            mg2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                     ty_args=R.Tensor((1,), "float32"))
            g1 = R.multiply(x, w2)
            mg1 = R.call_pure_packed("raf_dist.mark_gradient", g1, R.prim_value(0),
                                     ty_args=R.Tensor((3,), "float32"))
            nm1 = R.add(m1, mg1)
            nv1 = R.add(v1, R.multiply(mg1, mg1))
            new_w1 = R.subtract(w1, R.multiply(R.divide(nm1, R.sqrt(nv1)), lr))
            nm2 = R.add(m2, mg2)
            nv2 = R.add(v2, R.multiply(mg2, mg2))
            new_w2 = R.subtract(w2, R.multiply(R.divide(nm2, R.sqrt(nv2)), lr))
            out = (loss, new_w1, new_w2, nm1, nv1, nm2, nv2, new_run)
            R.output(out)
        return out


@I.ir_module
class ExpectedTwoStatesAndBuffer:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((3,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((3,), dtype="float32"), bucket0__state1: R.Tensor((3,), dtype="float32"), lr: R.Tensor((), dtype="float32"), run: R.Tensor((3,), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((3,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 2, "raf_dist.updated_arguments": [1, 2, 3, 4, 6], "raf_dist.zero_level": 1})
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, w1)
            new_run: R.Tensor((3,), dtype="float32") = R.add(run, y)
            lv2: R.Tensor((3,), dtype="float32") = R.multiply(y, w2)
            loss: R.Tensor((), dtype="float32") = R.sum(lv2, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, w2)
            grad_shard0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            R.output(new_run, loss, g2, g1, grad_shard0)
        R.call_packed("raf_dist.ccl.reduce_scatter", g2, g1, R.str("avg"), 0, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shard0 = R.call_dps_packed("raf_dist.ccl.local_shard", (w2, w1, 0), out_ty=R.Tensor((3,), dtype="float32"))
            nm2_b0: R.Tensor((3,), dtype="float32") = R.add(bucket0__state0, grad_shard0)
            lv16_b0: R.Tensor((3,), dtype="float32") = R.multiply(grad_shard0, grad_shard0)
            nv2_b0: R.Tensor((3,), dtype="float32") = R.add(bucket0__state1, lv16_b0)
            lv18_b0: R.Tensor((3,), dtype="float32") = R.sqrt(nv2_b0)
            lv19_b0: R.Tensor((3,), dtype="float32") = R.divide(nm2_b0, lv18_b0)
            lv20_b0: R.Tensor((3,), dtype="float32") = R.multiply(lv19_b0, lr)
            new_w2_b0: R.Tensor((3,), dtype="float32") = R.subtract(param_shard0, lv20_b0)
            R.output(nm2_b0, nv2_b0, new_w2_b0)
        R.call_packed("raf_dist.ccl.allgather", new_w2_b0, 0, w2, w1, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((3,), dtype="float32")) = loss, w1, w2, nm2_b0, nv2_b0, new_run
        return step_outputs


def test_one_bucket_serial_structure():
    tvm.ir.assert_structural_equal(ShardZeRO(1, 2, 1000, overlap=False)(Before),
                                   ExpectedOneBucketSerial)


def test_two_buckets_overlap_structure():
    tvm.ir.assert_structural_equal(ShardZeRO(1, 2, 4, overlap=True, group=5)(Before),
                                   ExpectedTwoBucketsOverlap)


def test_two_states_and_a_buffer_structure():
    tvm.ir.assert_structural_equal(ShardZeRO(1, 2, 1000, overlap=False)(BeforeTwoStatesAndBuffer),
                                   ExpectedTwoStatesAndBuffer)


def test_two_buckets_keep_the_buffer_argument_index():
    """Two buckets x two states: still four state arguments, so the buffer stays argument 8."""
    func = ShardZeRO(1, 2, 4, overlap=False)(BeforeTwoStatesAndBuffer)["train_step"]
    assert [p.name for p in func.params[3:7]] == [
        "bucket0__state0", "bucket0__state1", "bucket1__state0", "bucket1__state1"]
    assert [int(i) for i in func.attrs["raf_dist.updated_arguments"]] == [1, 2, 3, 4, 5, 6, 8]
    assert func.params[8].name == "run"


def test_guarded_structure():
    tvm.ir.assert_structural_equal(ShardZeRO(1, 2, 1000, overlap=False, guard=True)(Before),
                                   ExpectedGuarded)


@pytest.mark.parametrize("world_size, shards", [(1, [1, 3]), (2, [1, 2]), (3, [1, 1]),
                                                (4, [1, 1])])
def test_state_shard_sizes_follow_ceil_numel_over_n(world_size, shards):
    """Bucket b's state argument holds sum of ceil(numel / N) over its tensors (w2 then w1)."""
    func = ShardZeRO(1, world_size, 4, overlap=False)(Before)["train_step"]
    states = [(p.name, [int(d) for d in p.ty.shape]) for p in func.params[3:5]]
    assert states == [("bucket0__state0", [shards[0]]), ("bucket1__state0", [shards[1]])]
    # parameters stay whole at level 1
    assert [[int(d) for d in p.ty.shape] for p in func.params[1:3]] == [[3], [1]]


def test_multiple_dataflow_blocks_are_rejected():
    once = ShardZeRO(1, 2, 1000, overlap=False)(Before)  # already split around collectives
    with pytest.raises(ValueError, match="one dataflow block"):
        ShardZeRO(1, 2, 1000)(once)


def test_missing_gradient_marker_is_rejected():
    @I.ir_module
    class OneMarker:
        @R.function
        def train_step(x: R.Tensor((3,), "float32"), w1: R.Tensor((3,), "float32"),
                       w2: R.Tensor((3,), "float32")):
            R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 2,
                         "raf_dist.states_per_param": 0})
            with R.dataflow():
                loss = R.sum(R.multiply(R.multiply(x, w1), w2))
                m1 = R.call_pure_packed("raf_dist.mark_gradient", x, R.prim_value(0),
                                        ty_args=R.Tensor((3,), "float32"))
                new_w1 = R.subtract(w1, m1)
                out = (loss, new_w1, w2)
                R.output(out)
            return out

    with pytest.raises(ValueError, match="exactly one gradient marker"):
        ShardZeRO(1, 2, 1000)(OneMarker)


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0, "bucket_bytes": 16}, "world_size must be >= 1"),
    ({"world_size": 2, "bucket_bytes": 0}, "bucket_bytes must be > 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardZeRO(1, **kwargs)

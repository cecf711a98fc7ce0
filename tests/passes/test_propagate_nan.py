"""PropagateNaN: relu, maximum, minimum and clip keep a NaN input NaN (structure: the
expected selects; numbers: generated code against numpy/PyTorch semantics)."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.propagate_nan import PropagateNaN


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor((4,), "float32")):
        with R.dataflow():
            a = R.nn.relu(x)
            b = R.maximum(x, y)
            c = R.minimum(x, y)
            d = R.clip(x, -1.0, 1.0)
            R.output(a, b, c, d)
        return (a, b, c, d)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4,), "float32"), y: R.Tensor((4,), "float32")):
        with R.dataflow():
            nan_x = R.isnan(x)
            relu = R.nn.relu(x)
            a = R.where(nan_x, x, relu)
            nan_xy = R.logical_or(R.isnan(x), R.isnan(y))
            sum_b = R.add(x, y)
            maximum = R.maximum(x, y)
            b = R.where(nan_xy, sum_b, maximum)
            nan_xy2 = R.logical_or(R.isnan(x), R.isnan(y))
            sum_c = R.add(x, y)
            minimum = R.minimum(x, y)
            c = R.where(nan_xy2, sum_c, minimum)
            nan_x2 = R.isnan(x)
            clip = R.clip(x, -1.0, 1.0)
            d = R.where(nan_x2, x, clip)
            R.output(a, b, c, d)
        return (a, b, c, d)


@I.ir_module
class Integer:
    @R.function
    def main(x: R.Tensor((4,), "int32")):
        with R.dataflow():
            a = R.nn.relu(x)
            R.output(a)
        return a


def test_float_ops_get_a_nan_select():
    tvm.ir.assert_structural_equal(PropagateNaN()(Before), Expected)


def test_integer_ops_are_left_alone():
    tvm.ir.assert_structural_equal(PropagateNaN()(Integer), Integer)


def test_nan_propagates_in_generated_code():
    x = np.array([np.nan, 1, -1, 2], "float32")
    y = np.array([0, np.nan, 0, 5], "float32")
    vm = relax.VirtualMachine(tvm.compile(PropagateNaN()(Before), target="llvm"), tvm.cpu())
    a, b, c, d = (t.numpy() for t in vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)))
    np.testing.assert_array_equal(a, [np.nan, 1, 0, 2])  # torch.relu
    np.testing.assert_array_equal(b, [np.nan, np.nan, 0, 5])  # torch.maximum
    np.testing.assert_array_equal(c, [np.nan, np.nan, -1, 2])  # torch.minimum
    np.testing.assert_array_equal(d, [np.nan, 1, -1, 1])  # torch.clamp

"""MaxPoolGradient: max_pool2d's gradient from single-value reductions (structure), equal to
PyTorch's autograd for non-overlapping, overlapping, padded and ceil-mode pooling and for
ties (the first maximum of a window, row-major, gets the gradient)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

from raf_dist.passes import MaxPoolGradient

CASES = [  # (input shape, kernel, stride, padding, ceil_mode)
    ((8, 4, 8, 8), 2, 2, 0, False),   # the test CNN's pooling
    ((2, 3, 9, 9), 3, 2, 1, False),   # ResNet's stem pooling: overlapping windows, padding
    ((2, 3, 7, 7), 3, 1, 1, False),   # stride 1: up to 9 windows per input element
    ((2, 3, 7, 7), 2, 2, 0, True),    # ceil mode: a partial last window
]


def _module(shape, kernel, stride, padding, ceil_mode):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    out_shape = F.max_pool2d(torch.zeros(shape), kernel, stride, padding, ceil_mode=ceil_mode).shape
    dy = relax.Var("dy", relax.TensorType(tuple(out_shape), "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            gx = bb.emit_output(relax.op.grad.max_pool2d_backward(
                dy, x, pool_size=(kernel, kernel), strides=(stride, stride),
                padding=(padding, padding, padding, padding), dilation=(1, 1),
                ceil_mode=ceil_mode))
        bb.emit_func_output(gx)
    return bb.get(), tuple(out_shape)


def _ops(func):
    names = []
    relax.analysis.post_order_visit(func, lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def test_max_pool2d_backward_is_rewritten():
    mod, _ = _module(*CASES[0])
    ops = _ops(MaxPoolGradient()(mod)["main"])
    assert "relax.grad.max_pool2d_backward" not in ops and ops.count("relax.call_tir") == 1


@pytest.mark.parametrize("shape, kernel, stride, padding, ceil_mode", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_gradient_equals_torch(shape, kernel, stride, padding, ceil_mode, ties):
    mod, out_shape = _module(shape, kernel, stride, padding, ceil_mode)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype("float32")
    if ties:  # few distinct values: most windows hold their maximum more than once
        x = np.round(x).clip(-1, 1).astype("float32")
    dy = rng.standard_normal(out_shape).astype("float32")
    tx = torch.from_numpy(x).requires_grad_()
    F.max_pool2d(tx, kernel, stride, padding, ceil_mode=ceil_mode).backward(torch.from_numpy(dy))
    vm = relax.VirtualMachine(tvm.compile(MaxPoolGradient()(mod), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(dy), tvm.runtime.tensor(x)).numpy()
    # each element is a sum of at most 9 window gradients: float32 rounding only
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-6, atol=1e-6)

"""Gradients registered by raf_dist.training.gradients against central finite differences
in float64 (float32 with PyTorch autograd for layer_norm, which does not legalize in
float64 on TVM 0.27)."""
import numpy as np
import pytest
import tvm
from tvm import relax

import raf_dist.training.gradients  # noqa: F401  (registers the gradients)
import raf_dist.training.gradients_spatial  # noqa: F401

op = relax.op


def _compile_loss_and_grad(make_output, shapes, dtype, weight_seed=0):
    """f(xs) = sum(make_output(xs) * w); returns (loss_fn, grad_fn) on numpy arrays."""
    xs = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", xs):
        with bb.dataflow():
            y = bb.emit(make_output(*xs))
            w = np.random.default_rng(weight_seed).standard_normal(
                [int(d) for d in y.ty.shape]).astype(dtype)
            loss = bb.emit(op.sum(op.multiply(y, relax.const(w, dtype))))
            out = bb.emit_output(loss)
        bb.emit_func_output(out)
    mod = relax.transform.Gradient("main")(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())

    def loss_fn(*arrays):
        return float(vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy())

    def grad_fn(*arrays):
        _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in arrays])
        return [g.numpy() for g in grads]

    return loss_fn, grad_fn


def _finite_difference(loss_fn, arrays, index, eps=1e-6):
    x = arrays[index]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[index][i] += eps
        minus[index][i] -= eps
        grad[i] = (loss_fn(*plus) - loss_fn(*minus)) / (2 * eps)
    return grad


UNARY = {
    "gelu": (op.nn.gelu, lambda x: x),
    "gelu_tanh": (op.nn.gelu_tanh, lambda x: x),
    "erf": (op.erf, lambda x: x),
    "rsqrt": (op.rsqrt, lambda x: np.abs(x) + 0.5),  # keep away from 0
    "square": (op.square, lambda x: x),
    "leakyrelu": (lambda x: op.nn.leakyrelu(x, 0.1), lambda x: x + np.sign(x) * 0.1),
    "softplus": (lambda x: op.nn.softplus(x, 2.0, 20.0), lambda x: x),
    "squeeze": (lambda x: op.squeeze(x, [1]), lambda x: x),
    "flatten": (op.flatten, lambda x: x),
    "max_axis": (lambda x: op.max(x, [2]), lambda x: x),
    "min_keepdims": (lambda x: op.min(x, [0, 2], keepdims=True), lambda x: x),
    "tril": (lambda x: op.tril(x, 0), lambda x: x),
    "triu": (lambda x: op.triu(x, 1), lambda x: x),
    "clip": (lambda x: op.clip(x, -0.5, 0.7), lambda x: x + 0.01),  # keep off the corners
    "strided_slice": (lambda x: op.strided_slice(x, axes=[1, 0], begin=[1, -2], end=[3, 3]),
                      lambda x: x),
    "pad": (lambda x: op.nn.pad(x, [1, 0, 2, 3], pad_value=0.5), lambda x: x),
    "repeat_axis": (lambda x: op.repeat(x, 3, axis=1), lambda x: x),
    "repeat_flat": (lambda x: op.repeat(x, 2), lambda x: x),
    "tile": (lambda x: op.tile(x, [2, 1, 3]), lambda x: x),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_gradient_float64(name):
    make, prepare = UNARY[name]
    shape = (3, 1, 4) if name in ("squeeze", "flatten", "max_axis", "min_keepdims") else (3, 4)
    x = prepare(np.random.default_rng(1).standard_normal(shape)).astype("float64")
    loss_fn, grad_fn = _compile_loss_and_grad(make, [shape], "float64")
    analytic = grad_fn(x)[0]
    numeric = _finite_difference(loss_fn, [x], 0)
    # central differences in float64 with eps=1e-6 are accurate to ~1e-9 here
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)


def test_gather_elements_float64():
    indices = relax.const(np.array([[0, 2, 2, 1], [1, 0, 3, 3], [4, 4, 0, 2]]), "int64")
    x = np.random.default_rng(4).standard_normal((3, 5))
    loss_fn, grad_fn = _compile_loss_and_grad(lambda t: op.gather_elements(t, indices, axis=1),
                                              [(3, 5)], "float64")
    np.testing.assert_allclose(grad_fn(x)[0], _finite_difference(loss_fn, [x], 0),
                               rtol=1e-6, atol=1e-7)


def test_take_with_2d_indices_float64():
    indices = relax.const(np.array([[0, 2, 2], [1, 0, 3]]), "int64")
    x = np.random.default_rng(2).standard_normal((4, 5))
    loss_fn, grad_fn = _compile_loss_and_grad(lambda t: op.take(t, indices, axis=0), [(4, 5)],
                                              "float64")
    np.testing.assert_allclose(grad_fn(x)[0], _finite_difference(loss_fn, [x], 0),
                               rtol=1e-6, atol=1e-7)


def test_layer_norm_gradient_against_torch():
    import torch

    rng = np.random.default_rng(3)
    x, gamma, beta = (rng.standard_normal(s).astype("float32") for s in [(2, 3, 8), (8,), (8,)])
    loss_fn, grad_fn = _compile_loss_and_grad(
        lambda a, g, b: op.nn.layer_norm(a, g, b, axes=[-1], epsilon=1e-5),
        [(2, 3, 8), (8,), (8,)], "float32")
    w = np.random.default_rng(0).standard_normal((2, 3, 8)).astype("float32")
    tx, tg, tb = (torch.tensor(a, requires_grad=True) for a in (x, gamma, beta))
    (torch.nn.functional.layer_norm(tx, (8,), tg, tb, eps=1e-5) * torch.tensor(w)).sum().backward()
    for got, want in zip(grad_fn(x, gamma, beta), (tx.grad, tg.grad, tb.grad)):
        # float32 with different reduction order: a few ulps of the largest entries
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_rms_norm_gradient_against_torch():
    # TVM's float64 rms_norm is off by ~1e-7 (it does not compute in full float64), which
    # finite differences would amplify; PyTorch's autograd is the reference instead.
    import torch

    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 3, 6)), rng.standard_normal((6,))
    _, grad_fn = _compile_loss_and_grad(
        lambda a, b: op.nn.rms_norm(a, b, axes=[-1], epsilon=1e-5), [(2, 3, 6), (6,)], "float64")
    weights = np.random.default_rng(0).standard_normal((2, 3, 6))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (torch.nn.functional.rms_norm(tx, (6,), tw, eps=1e-5) * torch.tensor(weights)).sum().backward()
    for got, want in zip(grad_fn(x, w), (tx.grad, tw.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [None, "TopLeft", "BottomRight"])
def test_attention_gradient_float64(causal):
    rng = np.random.default_rng(6)
    shapes = [(2, 3, 2, 4), (2, 5, 2, 4), (2, 5, 2, 3)]  # q (B, S, H, D), k, v with S_kv = 5
    arrays = [rng.standard_normal(s) for s in shapes]
    loss_fn, grad_fn = _compile_loss_and_grad(
        lambda q, k, v: op.nn.attention(q, k, v, causal_mask=causal), shapes, "float64")
    analytic = grad_fn(*arrays)
    for index in range(3):
        np.testing.assert_allclose(analytic[index], _finite_difference(loss_fn, arrays, index),
                                   rtol=1e-6, atol=1e-7)

"""IR tier for DispatchToBLAS: TVMScript Before / Expected, structural equality."""
import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes import DispatchToBLAS


def test_folds_weight_transpose_like_linear():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 4), "float32"), w: R.Tensor((16, 4), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                y = R.matmul(x, wt, out_dtype="float32")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((8, 4), "float32"), w: R.Tensor((16, 4), "float32")):
            with R.dataflow():
                y = R.call_dps_packed("raf_dist.blas.matmul", (x, w, R.prim_value(0), R.prim_value(1)),
                                      out_ty=R.Tensor((8, 16), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(DispatchToBLAS()(Before), Expected)


def test_folds_both_batched_transposes_and_keeps_other_permutes():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3, 5, 4), "float32"), b: R.Tensor((2, 3, 6, 5), "float32"),
                 c: R.Tensor((3, 2, 6, 4), "float32")):
            with R.dataflow():
                at = R.permute_dims(a, axes=[0, 1, 3, 2])
                bt = R.permute_dims(b, axes=[0, 1, 3, 2])
                ab = R.matmul(at, bt, out_dtype="float32")
                ct = R.permute_dims(c, axes=[1, 0, 2, 3])  # not a last-two swap: stays
                y = R.matmul(ab, ct, out_dtype="float32")
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3, 5, 4), "float32"), b: R.Tensor((2, 3, 6, 5), "float32"),
                 c: R.Tensor((3, 2, 6, 4), "float32")):
            with R.dataflow():
                ab = R.call_dps_packed("raf_dist.blas.matmul", (a, b, R.prim_value(1), R.prim_value(1)),
                                       out_ty=R.Tensor((2, 3, 4, 6), "float32"))
                ct = R.permute_dims(c, axes=[1, 0, 2, 3])
                y = R.call_dps_packed("raf_dist.blas.matmul", (ab, ct, R.prim_value(0), R.prim_value(0)),
                                      out_ty=R.Tensor((2, 3, 4, 4), "float32"))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(DispatchToBLAS()(Before), Expected)


@I.ir_module
class WideningAndVector:
    @R.function
    def main(x: R.Tensor((8, 4), "float16"), w: R.Tensor((4, 2), "float16"),
             v: R.Tensor((4,), "float32"), m: R.Tensor((3, 4), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")  # output wider than the operands: TVM's
            z = R.matmul(m, v)  # rank-1 operand: stays with TVM
            R.output(y, z)
        return (y, z)


@I.ir_module
class Integer:
    @R.function
    def main(x: R.Tensor((8, 4), "int32"), w: R.Tensor((4, 2), "int32")):
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [WideningAndVector, Integer],
                         ids=["widening_and_vector", "int32"])
def test_leaves_non_blas_dtypes_and_vectors(mod):
    tvm.ir.assert_structural_equal(DispatchToBLAS()(mod), mod)


def test_numerics_of_dispatched_matmul_with_transposes():
    import numpy as np
    from tvm import relax

    import raf_dist.runtime  # noqa: F401  (registers raf_dist.blas.matmul)

    @I.ir_module
    class Mod:
        @R.function
        def main(a: R.Tensor((2, 5, 4), "float32"), b: R.Tensor((6, 5), "float32")):
            with R.dataflow():
                at = R.permute_dims(a, axes=[0, 2, 1])
                bt = R.permute_dims(b, axes=[1, 0])
                y = R.matmul(at, bt, out_dtype="float32")
                R.output(y)
            return y

    vm = relax.VirtualMachine(tvm.compile(DispatchToBLAS()(Mod), target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 5, 4), "float32"), rng.standard_normal((6, 5), "float32")
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    np.testing.assert_allclose(got, np.swapaxes(a, 1, 2) @ b.T, rtol=1e-5)


def test_conv2d_and_its_gradient_forms_dispatch():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 dy: R.Tensor((2, 4, 4, 4), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, strides=[2, 2], padding=[1, 1, 1, 1])
                dx = R.nn.conv2d_transpose(dy, w, strides=[2, 2], padding=[1, 1, 1, 1],
                                           output_padding=[1, 1], kernel_layout="IOHW")
                dw = R.nn.conv2d(x, dy, strides=[1, 1], padding=[1, 1, 1, 1], dilation=[2, 2],
                                 data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW")
                R.output(y, dx, dw)
            return (y, dx, dw)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 dy: R.Tensor((2, 4, 4, 4), "float32")):
            with R.dataflow():
                y = R.call_dps_packed("raf_dist.blas.conv2d", (x, w, R.shape([2, 2]), R.shape([1, 1, 1, 1]),
                                      R.shape([1, 1]), R.str("NCHW,OIHW,NCHW")),
                                      out_ty=R.Tensor((2, 4, 4, 4), "float32"))
                dx = R.call_dps_packed("raf_dist.blas.conv2d_transpose",
                                       (dy, w, R.shape([2, 2]), R.shape([1, 1, 1, 1]), R.shape([1, 1]),
                                        R.shape([1, 1]), R.str("NCHW,IOHW,NCHW")),
                                       out_ty=R.Tensor((2, 3, 8, 8), "float32"))
                dw = R.call_dps_packed("raf_dist.blas.conv2d", (x, dy, R.shape([1, 1]), R.shape([1, 1, 1, 1]),
                                       R.shape([2, 2]), R.str("CNHW,IOHW,CNHW")),
                                       out_ty=R.Tensor((4, 3, 4, 4), "float32"))
                R.output(y, dx, dw)
            return (y, dx, dw)

    tvm.ir.assert_structural_equal(DispatchToBLAS()(Before), Expected)


def test_grouped_conv_stays_with_tvm():
    @I.ir_module
    class Grouped:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 6), "float32"), w: R.Tensor((4, 1, 3, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, groups=4)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(DispatchToBLAS()(Grouped), Grouped)



@pytest.mark.parametrize("n, c, h, o, k, stride, pad, dil", [
    (2, 3, 7, 4, 3, 1, 1, 1), (2, 3, 7, 4, 3, 2, 1, 1), (3, 5, 9, 2, 3, 2, 1, 2),
    (4, 8, 5, 6, 1, 1, 0, 1),   # 1x1: one GEMM per sample from and into NCHW
    (2, 4, 6, 3, 1, 2, 0, 1),   # strided 1x1 (a ResNet downsample): im2col
    (2, 4, 1, 8, 3, 1, 1, 1)])  # a 1x1 map under a padded 3x3 kernel (ResNet at 32x32)
def test_blas_conv2d_equals_torch_in_both_layouts(n, c, h, o, k, stride, pad, dil):
    """raf_dist.blas.conv2d against torch's conv2d, in the forward layout and in the
    CNHW/IOHW/CNHW form the weight gradient uses."""
    import torch
    import tvm_ffi

    from raf_dist.runtime import blas

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    w = rng.standard_normal((o, c, k, k)).astype(np.float32)
    ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=stride,
                                     padding=pad, dilation=dil).numpy()
    args = ([stride, stride], [pad] * 4, [dil, dil])
    out = np.empty_like(ref)
    blas.conv2d(tvm_ffi.from_dlpack(x), tvm_ffi.from_dlpack(w), *args, "NCHW,OIHW,NCHW",
                tvm_ffi.from_dlpack(out))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    cn = np.empty(ref.transpose(1, 0, 2, 3).shape, np.float32)
    blas.conv2d(tvm_ffi.from_dlpack(np.ascontiguousarray(x.transpose(1, 0, 2, 3))),
                tvm_ffi.from_dlpack(np.ascontiguousarray(w.transpose(1, 0, 2, 3))), *args,
                "CNHW,IOHW,CNHW", tvm_ffi.from_dlpack(cn))
    np.testing.assert_allclose(cn.transpose(1, 0, 2, 3), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, c, h, o, k, stride, pad, dil", [
    (2, 3, 7, 4, 3, 1, 1, 1), (2, 3, 8, 4, 3, 2, 1, 1), (3, 5, 9, 2, 3, 2, 1, 2),
    (2, 4, 6, 3, 1, 2, 0, 1), (2, 4, 1, 8, 3, 1, 1, 1)])
def test_blas_conv2d_transpose_is_the_data_gradient_of_conv2d(n, c, h, o, k, stride, pad, dil):
    """raf_dist.blas.conv2d_transpose of dy with the forward weight equals torch's gradient
    of conv2d with respect to its input."""
    import torch
    import tvm_ffi

    from raf_dist.runtime import blas

    rng = np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal((n, c, h, h)).astype(np.float32), requires_grad=True)
    w = torch.tensor(rng.standard_normal((o, c, k, k)).astype(np.float32))
    y = torch.nn.functional.conv2d(x, w, stride=stride, padding=pad, dilation=dil)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy))
    out = np.empty((n, c, h, h), np.float32)
    blas.conv2d_transpose(tvm_ffi.from_dlpack(dy), tvm_ffi.from_dlpack(w.numpy()),
                          [stride, stride], [pad] * 4, [0, 0], [dil, dil], "NCHW,IOHW,NCHW",
                          tvm_ffi.from_dlpack(out))
    np.testing.assert_allclose(out, x.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, c, h, o, k, stride, pad", [
    (2, 3, 7, 4, 3, 1, 1), (2, 3, 8, 4, 3, 2, 1), (4, 8, 1, 6, 3, 1, 1), (4, 8, 2, 6, 3, 2, 1)])
def test_blas_conv2d_in_the_weight_gradient_form_equals_autograd(n, c, h, o, k, stride, pad):
    """The weight gradient as the conv2d gradient emits it (x as CNHW, dy as an IOHW kernel
    dilated by the stride, output CNHW, cut to the kernel size) equals torch's; the 1x1 and
    2x2 maps exercise the outputs and taps that read padding only."""
    import torch
    import tvm_ffi

    from raf_dist.runtime import blas

    rng = np.random.default_rng(2)
    x = torch.tensor(rng.standard_normal((n, c, h, h)).astype(np.float32))
    w = torch.tensor(rng.standard_normal((o, c, k, k)).astype(np.float32), requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, stride=stride, padding=pad)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy))
    p = dy.shape[2]
    size = (h + 2 * pad - stride * (p - 1) - 1) + 1  # this conv's output rows (stride 1)
    out = np.empty((o, c, size, size), np.float32)  # CNHW of (C = o, N = c)
    blas.conv2d(tvm_ffi.from_dlpack(x.numpy()), tvm_ffi.from_dlpack(dy), [1, 1], [pad] * 4,
                [stride, stride], "CNHW,IOHW,CNHW", tvm_ffi.from_dlpack(out))
    np.testing.assert_allclose(out[:, :, :k, :k], w.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["native", "widen"])
def test_bf16_matmul_dispatched_and_accumulated_in_float32(mode, monkeypatch):
    """A 16-bit matmul goes to raf_dist.blas.matmul (runtime/blas.py), whose two ways both
    sum in float32 and round once: a 4096-long dot product of ones is 4096 (a bf16 running
    sum stops at 256)."""
    import ml_dtypes
    import numpy as np
    from tvm import relax

    from raf_dist.runtime import blas

    monkeypatch.setitem(blas._modes, "bfloat16", mode)

    @I.ir_module
    class Mod:
        @R.function
        def main(a: R.Tensor((2, 4096), "bfloat16"), b: R.Tensor((4096, 3), "bfloat16")):
            with R.dataflow():
                y = R.matmul(a, b)
                R.output(y)
            return y

    dispatched = DispatchToBLAS()(Mod)
    assert "raf_dist.blas.matmul" in dispatched.script()
    exe = tvm.compile(dispatched, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    ones = [np.ones(s, ml_dtypes.bfloat16) for s in ((2, 4096), (4096, 3))]
    out = vm["main"](*[tvm.runtime.tensor(a) for a in ones]).numpy()
    assert out.astype(np.float32).tolist() == [[4096.0] * 3] * 2

"""``raf_dist.blas.*``: matmul and convolution on zero-copy DLPack views of the step's
tensors — numpy's BLAS for host tensors, CuPy (cuBLAS) for CUDA tensors.

numpy and CuPy hand a transposed view of a contiguous matrix to gemm as a transpose flag, so
folded transposes cost nothing; batched operands (rank > 2, broadcasting like np.matmul) run
one gemm per matrix. (Splitting a batch of small matrices, which BLAS runs on one thread,
across threads was tried: no gain on the GPT's attention products, 64 of 64x32 on 2 cores,
0.30-0.42 ms either way.) The functions are written once against the array module of their
arguments (``_xp``). On the GPU, CuPy launches on its current stream, the legacy default
stream, which TVM's kernels also use, so they stay ordered.
"""
import numpy as np
import tvm_ffi

BLAS_MATMUL = "raf_dist.blas.matmul"
_CUDA = 2  # kDLCUDA


def _xp(tensor):
    """numpy for host tensors, cupy for CUDA tensors."""
    if tensor.device.dlpack_device_type() != _CUDA:
        return np
    try:
        import cupy
    except ImportError as e:
        raise ImportError("a CUDA step dispatches matmul/convolution to CuPy: install "
                          "raf_dist[cuda12] or raf_dist[cuda13]") from e
    return cupy


def matmul(a, b, trans_a, trans_b, out):
    xp = _xp(out)
    a = xp.from_dlpack(a)
    b = xp.from_dlpack(b)
    if trans_a:
        a = xp.swapaxes(a, -1, -2)
    if trans_b:
        b = xp.swapaxes(b, -1, -2)
    xp.matmul(a, b, out=xp.from_dlpack(out))


tvm_ffi.register_global_func(BLAS_MATMUL, matmul, override=True)


BLAS_CONV2D = "raf_dist.blas.conv2d"
BLAS_CONV2D_TRANSPOSE = "raf_dist.blas.conv2d_transpose"


def _as_layout(xp, array, layout, target):
    """View ``array`` (in ``layout``) with its axes in ``target`` order (no copy)."""
    return xp.transpose(array, [layout.index(axis) for axis in target])


def conv2d(data, weight, strides, padding, dilation, layouts, out):
    """Convolution as im2col + GEMM: the sliding windows of the padded input are a strided
    view, copied once into the (N*P*Q, C*KH*KW) column matrix; the weight enters the GEMM as
    its (O, C*KH*KW) view with BLAS's transpose flag. (``np.tensordot`` was used before: it
    transposes its second operand before the reshape, copying the whole weight on every call
    — 9 MB for a 512x512x3x3 kernel, most of that conv's time.) A 1x1 convolution without
    stride or padding is one GEMM per sample straight from and into NCHW, no copy at all.
    ``layouts`` is "data_layout,kernel_layout,out_layout" (e.g. "NCHW,OIHW,NCHW", or the
    CNHW/IOHW/CNHW form the conv2d gradient uses for the weight gradient)."""
    xp = _xp(out)
    data_layout, kernel_layout, out_layout = str(layouts).split(",")
    x = _as_layout(xp, xp.from_dlpack(data), data_layout, "NCHW")
    w = _as_layout(xp, xp.from_dlpack(weight), kernel_layout, "OIHW")
    o = _as_layout(xp, xp.from_dlpack(out), out_layout, "NCHW")
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = list(strides), list(padding), list(dilation)
    n, c = x.shape[:2]
    o_ch, _, kh, kw = w.shape
    p, q = o.shape[2:]
    w2 = w.reshape(o_ch, c * kh * kw)  # a view of a contiguous OIHW weight
    if (kh, kw, sh, sw, pt, pl, pb, pr) == (1, 1, 1, 1, 0, 0, 0, 0) and \
            x.flags.c_contiguous and o.flags.c_contiguous:
        xp.matmul(w2, x.reshape(n, c, p * q), out=o.reshape(n, o_ch, p * q))
        return
    x = xp.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    windows = xp.lib.stride_tricks.sliding_window_view(x, (span_h, span_w), axis=(2, 3))
    windows = windows[:, :, ::sh, ::sw, ::dh, ::dw][:, :, :p, :q]  # N C P Q KH KW
    cols = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * p * q, c * kh * kw)  # the copy
    o_first = o.transpose(1, 0, 2, 3)
    if o_first.flags.c_contiguous:
        # the output is held channel-first (CNHW: the weight-gradient form, where N is the
        # forward's channels and the "kernel" the output gradient): the GEMM writes it in
        # place as (O, C*KH*KW) x (N*P*Q, C*KH*KW)^T, instead of an (N*P*Q, O) result copied
        # through a transpose (2.4M strided elements for a 512x512x3x3 weight gradient)
        xp.matmul(w2, cols.T, out=o_first.reshape(o_ch, n * p * q))
        return
    result = cols @ w2.T  # N*P*Q x O
    xp.copyto(o, result.reshape(n, p, q, o_ch).transpose(0, 3, 1, 2))


def conv2d_transpose(data, weight, strides, padding, output_padding, dilation, layouts, out):
    """Transposed convolution (the data gradient of conv2d) as GEMM + col2im: one GEMM gives
    every kernel tap's contribution, laid out (O, KH, KW, N, P, Q) so that each tap is one
    contiguous block, added into its strided place of a channel-first buffer; one transposing
    copy writes the result. (Before, taps were cut from an (N, P, Q, O, KH, KW) tensordot
    result: every add read with a stride of O*KH*KW elements.)"""
    xp = _xp(out)
    data_layout, kernel_layout, out_layout = str(layouts).split(",")
    dy = _as_layout(xp, xp.from_dlpack(data), data_layout, "NCHW")  # N, I, P, Q
    w = _as_layout(xp, xp.from_dlpack(weight), kernel_layout, "IOHW")  # I, O, KH, KW
    o = _as_layout(xp, xp.from_dlpack(out), out_layout, "NCHW")  # N, O, H, W
    (sh, sw), (pt, pl, _, _), (dh, dw) = list(strides), list(padding), list(dilation)
    n, i_ch, p, q = dy.shape
    _, o_ch, kh, kw = w.shape
    dy_mat = dy.transpose(1, 0, 2, 3).reshape(i_ch, n * p * q)  # a copy of dy (small)
    cols = (w.reshape(i_ch, o_ch * kh * kw).T @ dy_mat).reshape(o_ch, kh, kw, n, p, q)
    full_h = max((p - 1) * sh + dh * (kh - 1) + 1, pt + o.shape[2])
    full_w = max((q - 1) * sw + dw * (kw - 1) + 1, pl + o.shape[3])
    full = xp.zeros((o_ch, n, full_h, full_w), dtype=o.dtype)  # channel-first
    for i in range(kh):
        for j in range(kw):
            full[:, :, i * dh:i * dh + sh * (p - 1) + 1:sh, j * dw:j * dw + sw * (q - 1) + 1:sw] += \
                cols[:, i, j]
    xp.copyto(o, full[:, :, pt:pt + o.shape[2], pl:pl + o.shape[3]].transpose(1, 0, 2, 3))


tvm_ffi.register_global_func(BLAS_CONV2D, conv2d, override=True)
tvm_ffi.register_global_func(BLAS_CONV2D_TRANSPOSE, conv2d_transpose, override=True)

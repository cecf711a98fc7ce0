"""``raf_dist.blas.*``: matmul and convolution on zero-copy DLPack views of the step's
tensors — numpy's BLAS for host tensors, CuPy (cuBLAS) for CUDA tensors; a GPU matmul goes
first to one direct cuBLAS call on the tensors' pointers (runtime/cublas.py).

numpy and CuPy hand a transposed view of a contiguous matrix to gemm as a transpose flag, so
folded transposes cost nothing; batched operands (rank > 2, broadcasting like np.matmul) run
one gemm per matrix; on the host, a batch of small matrices (the attention's per-head
products) is spread over the cores instead (``openblas.batched_matmul``). The functions are
written once against the array module of their arguments (``_xp``). On the GPU, CuPy
launches on its current stream, the legacy default stream, which TVM's kernels also use, so
they stay ordered.
"""
import logging
import time

import ml_dtypes
import numpy as np
import tvm_ffi

from .. import env
from . import cublas, openblas

logger = logging.getLogger("raf_dist")

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


#: 16-bit float operands: numpy has no 16-bit GEMM and cannot take them through DLPack
LOW_DTYPES = ("bfloat16", "float16")
_torch_module = []  # [torch or None], imported on first use


def _torch():
    """torch when installed (its CPU matmul is oneDNN's, which uses the CPU's bf16 dot-product
    instructions), else None."""
    if not _torch_module:
        try:
            import torch
        except ImportError:
            torch = None
        else:
            torch.set_num_threads(max(1, openblas.get_threads() or 1))
        _torch_module.append(torch)
    return _torch_module[0]


def torch_module():
    """torch (with the threads this rank's host kernels use) when installed, else None."""
    return _torch()


def _matmul_low(a, b, trans_a, trans_b, out):
    """A bfloat16 / float16 GEMM on the host, accumulated in float32 and rounded once into
    ``out``, by the faster of two ways on this machine (``low_gemm_mode``): oneDNN's 16-bit
    GEMM (``torch.matmul``; it uses the CPU's bf16 dot-product instructions where it has
    them), or the operands widened to float32 and multiplied by numpy's BLAS on TVM's pool,
    as every float32 matmul. numpy has no 16-bit float DLPack type: torch's ``from_dlpack``
    is the zero-copy bridge (a uint16 view of the same memory), and only the widen / narrow
    run in numpy, so no second thread pool competes with TVM's (measured: torch's own
    float32 GEMM inside a raf_dist step ran 5x slower than alone). Without torch the tensors
    are copied out."""
    dtype = str(out.dtype)
    torch = _torch()
    if torch is not None and low_gemm_mode(dtype) == "native":
        ta, tb, to = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack(out)
        if trans_a:
            ta = ta.transpose(-1, -2)
        if trans_b:
            tb = tb.transpose(-1, -2)
        threads = torch.get_num_threads()
        if threads > 1 and 2 * to.numel() * int(ta.shape[-1]) < _one_thread_below():
            torch.set_num_threads(1)
            try:
                torch.matmul(ta, tb, out=to)
            finally:
                torch.set_num_threads(threads)
            return
        torch.matmul(ta, tb, out=to)
        return
    x, y = _wide(a, dtype, torch), _wide(b, dtype, torch)
    if trans_a:
        x = np.swapaxes(x, -1, -2)
    if trans_b:
        y = np.swapaxes(y, -1, -2)
    wide = np.empty(tuple(out.shape), np.float32)
    if not (wide.ndim > 2 and openblas.batched_matmul(x, y, wide)):
        np.matmul(x, y, out=wide)
    narrow = wide.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    if torch is not None:
        _bits(out, torch)[...] = narrow.view(np.uint16)
    else:
        out.copyfrom(narrow)


def _bits(tensor, torch):
    """A uint16 numpy view of a 16-bit tensor's memory (zero-copy through torch's DLPack)."""
    return torch.from_dlpack(tensor).view(torch.int16).numpy().view(np.uint16)


def _wide(tensor, dtype, torch):
    """A float32 copy of a 16-bit tensor."""
    if torch is None:
        return tensor.numpy().astype(np.float32)
    bits = _bits(tensor, torch)
    if dtype == "bfloat16":  # a bfloat16 is the upper half of the float32 with its value
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


_modes = {}


def low_gemm_mode(dtype):
    """"native" or "widen": which of _matmul_low's ways multiplies ``dtype`` faster here,
    measured once per process on a 512 x 1024 x 1024 product (the issue's AMD EPYC with
    avx512_bf16 runs bf16 4.2x faster than float32; a CPU without it runs bf16 through
    oneDNN's reference path, several times slower than float32). RAF_DIST_LOW_GEMM=native
    or widen skips the measurement."""
    if dtype not in _modes:
        forced = env.low_gemm()
        if forced is not None:
            _modes[dtype] = forced
        else:
            torch = _torch()
            if torch is None:
                _modes[dtype] = "widen"
                return _modes[dtype]
            x = torch.randn(512, 1024).to(getattr(torch, dtype))
            w = torch.randn(1024, 1024).to(getattr(torch, dtype))
            out = torch.empty(512, 1024, dtype=x.dtype)
            xf, wf = x.float().numpy(), w.float().numpy()  # the widen path's own GEMM
            times = {}
            for mode in ("native", "widen", "native", "widen"):
                began = time.perf_counter()
                if mode == "native":
                    torch.matmul(x, w, out=out)
                else:
                    np.matmul(xf, wf).astype(ml_dtypes.bfloat16)
                times[mode] = min(times.get(mode, 1e9), time.perf_counter() - began)
            _modes[dtype] = min(times, key=times.get)
            if _modes[dtype] == "native" and not env.TORCH_OPENMP_PASSIVE:
                logger.warning("raf_dist.blas: %s GEMMs run on PyTorch's OpenMP threads, "
                               "which spin between GEMMs next to TVM's kernels (measured: "
                               "the bf16 GPT step 37 -> 49 ms); set OMP_WAIT_POLICY=PASSIVE "
                               "in the environment, or import raf_dist before torch", dtype)
            logger.info("raf_dist.blas: %s GEMM %s (native %.2f ms, widened to float32 "
                        "%.2f ms)", dtype, _modes[dtype], times["native"] * 1e3,
                        times["widen"] * 1e3)
    return _modes[dtype]


#: FLOPs (2 x M x N x K) below which a 16-bit GEMM runs on the calling thread alone
#: (``_matmul_low``); RAF_DIST_ONE_THREAD_GEMM_MFLOP overrides it
ONE_THREAD_GEMM_FLOPS = 64e6


def _one_thread_below():
    """FLOPs below which a 16-bit GEMM is faster on the calling thread alone than on
    PyTorch's OpenMP team, whatever the dtype and team size. raf_dist asks OpenMP's idle threads to sleep
    (OMP_WAIT_POLICY=PASSIVE: spinning, they took the cores TVM's kernels run on), so every
    GEMM first wakes them: ~90 us on this VM (a 1024 x 128 x 384 bf16 product: 78 us on one
    thread, 155 on two; 686 vs 1041 us at 1024 x 512 x 1536), which a small model's GEMMs
    pay 75 times a step. For one product the two lines cross at 230-310 MFLOP here, but a
    batched product (the attention's) keeps the team busy: the 23M GPT's 64 x 128 x 64 x 128
    (134 MFLOP) ran 2% slower a step on one thread, while step_time's GPT kept its gain at
    64 MFLOP (36.7 -> 33-35 ms; 256: 33-37). The threshold is a constant, not measured in
    each process: a measurement flipped between 0 and "always" from one process to the next
    on this shared host, and the thread count decides oneDNN's summation order, so a run
    and its resumption must choose alike."""
    return env.one_thread_gemm_flops(ONE_THREAD_GEMM_FLOPS)


def _matmul_low_cuda(a, b, trans_a, trans_b, out):
    """A batched 16-bit product on the GPU. CuPy 14 multiplies 2-D bfloat16 matrices (cuBLAS
    GemmEx) but takes a batched bfloat16 product for an integer one and fails ("data type 'E'
    not understood"; seen on an H200, the transformer's attention products): torch's CUDA
    matmul (cuBLAS, float32 accumulation) on the same memory when torch is installed, else
    one CuPy GEMM per matrix of the broadcast batch."""
    torch = _torch()
    if torch is not None:
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
        if trans_a:
            ta = ta.transpose(-1, -2)
        if trans_b:
            tb = tb.transpose(-1, -2)
        torch.matmul(ta, tb, out=torch.from_dlpack(out))
        return
    xp = _xp(out)
    x, y, o = xp.from_dlpack(a), xp.from_dlpack(b), xp.from_dlpack(out)
    if trans_a:
        x = xp.swapaxes(x, -1, -2)
    if trans_b:
        y = xp.swapaxes(y, -1, -2)
    batch = o.shape[:-2]
    x = xp.broadcast_to(x, batch + x.shape[-2:])
    y = xp.broadcast_to(y, batch + y.shape[-2:])
    for index in np.ndindex(*batch):
        xp.matmul(x[index], y[index], out=o[index])


def matmul(a, b, trans_a, trans_b, out):
    on_gpu = out.device.dlpack_device_type() == _CUDA
    if on_gpu and cublas.matmul(a, b, trans_a, trans_b, out):
        return
    if str(out.dtype) in LOW_DTYPES:
        if not on_gpu:
            _matmul_low(a, b, trans_a, trans_b, out)
            return
        if len(out.shape) > 2:
            _matmul_low_cuda(a, b, trans_a, trans_b, out)
            return
    xp = _xp(out)
    a = xp.from_dlpack(a)
    b = xp.from_dlpack(b)
    if trans_a:
        a = xp.swapaxes(a, -1, -2)
    if trans_b:
        b = xp.swapaxes(b, -1, -2)
    out = xp.from_dlpack(out)
    if xp is np and out.ndim > 2 and openblas.batched_matmul(a, b, out):
        return
    xp.matmul(a, b, out=out)


tvm_ffi.register_global_func(BLAS_MATMUL, matmul, override=True)


BLAS_CONV2D = "raf_dist.blas.conv2d"
BLAS_CONV2D_TRANSPOSE = "raf_dist.blas.conv2d_transpose"


def _as_layout(xp, array, layout, target):
    """View ``array`` (in ``layout``) with its axes in ``target`` order (no copy)."""
    return xp.transpose(array, [layout.index(axis) for axis in target])


def conv2d(data, weight, strides, padding, dilation, layouts, out):
    """Convolution as im2col + GEMM. ``layouts`` is "data_layout,kernel_layout,out_layout"
    (e.g. "NCHW,OIHW,NCHW", or the CNHW/IOHW/CNHW form the conv2d gradient uses for the
    weight gradient)."""
    xp = _xp(out)
    data_layout, kernel_layout, out_layout = str(layouts).split(",")
    x = _as_layout(xp, xp.from_dlpack(data), data_layout, "NCHW")
    w = _as_layout(xp, xp.from_dlpack(weight), kernel_layout, "OIHW")
    o = _as_layout(xp, xp.from_dlpack(out), out_layout, "NCHW")
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = list(strides), list(padding), list(dilation)
    kh, kw = w.shape[2:]
    rows = _useful(x.shape[2], o.shape[2], kh, sh, dh, pt)
    cols = _useful(x.shape[3], o.shape[3], kw, sw, dw, pl)
    if rows is None or cols is None:  # every output reads padding only
        o[...] = 0
        return
    (y0, y1, a0, a1), (x0, x1, b0, b1) = rows, cols
    all_outputs = (y0, y1, x0, x1) == (0, o.shape[2], 0, o.shape[3])
    if all_outputs and (a1 - a0) * (b1 - b0) * _PRUNE_BELOW > kh * kw:
        _conv2d(xp, x, w, o, (sh, sw), (pt, pl, pb, pr), (dh, dw))
        return
    # Outputs that read padding only are 0, and kernel taps that read padding only for every
    # other output add nothing: a 3x3 kernel over a 1x1 map (ResNet's last stage at 32x32
    # inputs) is its centre tap, 1/9 of the GEMM; a weight gradient's rows of such taps are 0.
    first_h, first_w = y0 * sh + a0 * dh - pt, x0 * sw + b0 * dw - pl  # input rows/cols read
    last_h = (y1 - 1) * sh + (a1 - 1) * dh - pt + 1
    last_w = (x1 - 1) * sw + (b1 - 1) * dw - pl + 1
    h, w_in = x.shape[2:]
    sub = x[:, :, max(first_h, 0):min(last_h, h), max(first_w, 0):min(last_w, w_in)]
    sub_pad = (max(-first_h, 0), max(-first_w, 0), max(last_h - h, 0), max(last_w - w_in, 0))
    part = xp.empty((o.shape[0], o.shape[1], y1 - y0, x1 - x0), dtype=o.dtype)
    _conv2d(xp, sub, xp.ascontiguousarray(w[:, :, a0:a1, b0:b1]), part, (sh, sw), sub_pad,
            (dh, dw))
    o[...] = 0
    o[:, :, y0:y1, x0:x1] = part


#: taps are left out when at most 1/_PRUNE_BELOW of the kernel is kept: the kept taps'
#: weight is copied, which costs more than the GEMM saves when most taps stay (measured: a
#: 256->512 3x3 stride-2 conv on a 2x2 map, 4 of 9 taps kept, 1.07 -> 1.87 ms)
_PRUNE_BELOW = 3


def _useful(size_in, size_out, k, stride, dil, pad_before):
    """Along one spatial axis: (first, end) of the outputs that read any input element, and
    (first, end) of the kernel taps that any of those outputs reads an input element with;
    None when no output does."""
    reads = [[0 <= y * stride + a * dil - pad_before < size_in for a in range(k)]
             for y in range(size_out)]
    outputs = [y for y in range(size_out) if any(reads[y])]
    if not outputs:
        return None
    y0, y1 = outputs[0], outputs[-1] + 1
    taps = [a for a in range(k) if any(reads[y][a] for y in range(y0, y1))]
    return y0, y1, taps[0], taps[-1] + 1


def _conv2d(xp, x, w, o, strides, padding, dilation):
    """conv2d on NCHW / OIHW / NCHW views: the sliding windows of the padded input are a
    strided view, copied once into the (N*P*Q, C*KH*KW) column matrix; the weight enters the
    GEMM as its (O, C*KH*KW) view with BLAS's transpose flag. (``np.tensordot`` was used
    before: it transposes its second operand before the reshape, copying the whole weight on
    every call.) A 1x1 convolution without stride or padding is one GEMM per sample straight
    from and into NCHW, no copy at all."""
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, padding, dilation
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
    # taps whose every contribution lands outside the kept output (in the forward's padding)
    # are left out of the GEMM: over a 1x1 map a padded 3x3 kernel is its centre tap
    i0, i1 = _kept_taps(w.shape[2], p, sh, dh, pt, o.shape[2])
    j0, j1 = _kept_taps(w.shape[3], q, sw, dw, pl, o.shape[3])
    if (i1 - i0) * (j1 - j0) * _PRUNE_BELOW <= w.shape[2] * w.shape[3]:
        w = xp.ascontiguousarray(w[:, :, i0:i1, j0:j1])
    else:
        i0, i1, j0, j1 = 0, w.shape[2], 0, w.shape[3]
    _, o_ch, kh, kw = w.shape
    dy_mat = dy.transpose(1, 0, 2, 3).reshape(i_ch, n * p * q)  # a copy of dy (small)
    cols = (w.reshape(i_ch, o_ch * kh * kw).T @ dy_mat).reshape(o_ch, kh, kw, n, p, q)
    full_h = max((p - 1) * sh + dh * (i1 - 1) + 1, pt + o.shape[2])
    full_w = max((q - 1) * sw + dw * (j1 - 1) + 1, pl + o.shape[3])
    full = xp.zeros((o_ch, n, full_h, full_w), dtype=o.dtype)  # channel-first
    for i in range(kh):
        for j in range(kw):
            top, left = (i + i0) * dh, (j + j0) * dw
            full[:, :, top:top + sh * (p - 1) + 1:sh, left:left + sw * (q - 1) + 1:sw] += \
                cols[:, i, j]
    xp.copyto(o, full[:, :, pt:pt + o.shape[2], pl:pl + o.shape[3]].transpose(1, 0, 2, 3))


def _kept_taps(k, size_in, stride, dil, pad_before, size_out):
    """(first, end) of the kernel taps of a transposed convolution whose contributions reach
    the kept output rows [pad_before, pad_before + size_out) for some input row."""
    kept = [a for a in range(k) if any(pad_before <= a * dil + y * stride < pad_before + size_out
                                       for y in range(size_in))]
    return (kept[0], kept[-1] + 1) if kept else (0, k)


tvm_ffi.register_global_func(BLAS_CONV2D, conv2d, override=True)
tvm_ffi.register_global_func(BLAS_CONV2D_TRANSPOSE, conv2d_transpose, override=True)

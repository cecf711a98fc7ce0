"""Collectives on numpy arrays (and any DLPack tensor), for tests, tools and the Trainer's
host-side bookkeeping. Compiled steps call the same native functions (``raf_dist.ccl.*``)
directly from the IR.

Buffers are shared with the native runtime without a copy. Sizes follow the padded flat
sharding of DESIGN.md section 3: ``reduce_scatter`` of S elements returns ceil(S / N) elements
(the tail of the last shards is zero padding), ``allgather`` of ceil(R / N) elements per rank
returns R elements.

Every call validates its arguments before any message is sent, so bad input on one rank
raises there instead of leaving the others waiting.
"""
import logging

import numpy as np

from .. import _native
from .communicator import get_communicator

logger = logging.getLogger("raf_dist")

try:  # bfloat16 for numpy; installed with apache-tvm
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - apache-tvm depends on ml_dtypes
    _BF16 = None


def as_tensor(array, what):
    """Zero-copy tvm-ffi view of a contiguous buffer (numpy bfloat16 included)."""
    import tvm_ffi  # on first use: raf_dist.run imports this package and must start fast

    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError(f"{what} is not C-contiguous; pass np.ascontiguousarray(x)")
        if _BF16 is not None and array.dtype == _BF16:
            return _native.func("reinterpret")(
                tvm_ffi.from_dlpack(array.view(np.uint16)), "bfloat16"
            )
        return tvm_ffi.from_dlpack(array)
    return tvm_ffi.from_dlpack(array) if not isinstance(array, tvm_ffi.Tensor) else array


def _output(out, like, numel):
    if out is None:
        return np.empty(numel, dtype=like.dtype)
    if not isinstance(out, np.ndarray) or out.dtype != like.dtype or out.size != numel:
        raise ValueError(
            f"out must be a numpy array of {numel} {like.dtype} elements, got "
            f"{getattr(out, 'size', '?')} {getattr(out, 'dtype', type(out).__name__)}"
        )
    return out


class Handle:
    """An asynchronous collective in flight. ``wait()`` completes it and returns its result.
    The buffers stay referenced (here and natively) until then. A handle dropped without a
    wait (as a ``torch.distributed`` Work may be) lets the runtime free the buffers once the
    collective completes, instead of holding them until exit; a warning names the
    collective, since its result was never looked at."""

    def __init__(self, native_handle, result, buffers, kind="collective"):
        self._handle = native_handle
        self._result = result
        self._buffers = buffers
        self._kind = kind
        self._done = False

    def __del__(self):
        if self._done:
            return
        try:
            released = _native.func("release")(self._handle)
        except Exception:  # interpreter shutdown: the runtime is gone or going
            return
        if released:
            logger.warning("an asynchronous %s (handle %d) was dropped without wait(); its "
                           "buffers are freed when it completes", self._kind, self._handle)

    def wait(self):
        if not self._done:
            _native.func("wait")(self._handle)
            self._done = True
            self._buffers = None
        return self._result


def _run(name, args, result, buffers, async_op):
    if async_op:
        return Handle(_native.func(name + "_start")(*args), result, buffers, name)
    _native.func(name)(*args)
    return result


def _group(group):
    return get_communicator().group if group is None else group


def allreduce(x, op="sum", out=None, async_op=False, group=None):
    """Reduce ``x`` across ranks with ``op`` in {'sum', 'avg', 'max', 'min'}.

    In place when ``out is x``. Returns the result (or a Handle with ``async_op``).
    """
    x = np.asarray(x)
    out = _output(out, x, x.size).reshape(x.shape) if out is not x else x
    args = (as_tensor(x, "input"), op, _group(group), as_tensor(out, "out"))
    return _run("allreduce", args, out, (x, out), async_op)


def reduce_scatter(x, op="sum", out=None, async_op=False, group=None):
    """Reduce ``x`` (flattened, S elements) across ranks; this rank gets its padded shard of
    ceil(S / N) elements."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = get_communicator().size if group is None else _native.func("group_size")(group)
    out = _output(out, x, -(-x.size // size))
    args = (as_tensor(x, "input"), op, _group(group), as_tensor(out, "out"))
    return _run("reduce_scatter", args, out, (x, out), async_op)


def allgather(x, numel=None, out=None, async_op=False, group=None):
    """Concatenate every rank's ``x`` (flattened, one shard each); the result has ``numel``
    elements (default: N times the shard, i.e. no padding to drop)."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = get_communicator().size if group is None else _native.func("group_size")(group)
    out = _output(out, x, x.size * size if numel is None else numel)
    args = (as_tensor(x, "input"), _group(group), as_tensor(out, "out"))
    return _run("allgather", args, out, (x, out), async_op)


def alltoall(x, out=None, async_op=False, group=None):
    """Personalised exchange in equal blocks: ``x`` (flattened, a multiple of N elements)
    is cut into N blocks, block j goes to rank j; the result's block j came from rank j
    (MPI_Alltoall; a grouped NCCL send/recv per rank on GPU memory)."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = get_communicator().size if group is None else _native.func("group_size")(group)
    if x.size % size:
        raise ValueError(f"alltoall: the input has {x.size} elements, not a multiple of the "
                         f"{size} ranks (one equal block per rank); pad it, or use alltoallv "
                         "with per-rank counts")
    out = _output(out, x, x.size)
    args = (as_tensor(x, "input"), _group(group), as_tensor(out, "out"))
    return _run("alltoall", args, out, (x, out), async_op)


def alltoallv(x, send_counts, recv_counts=None, out=None, async_op=False, group=None):
    """Personalised exchange in uneven blocks: the first ``send_counts[0]`` elements of ``x``
    (flattened) go to rank 0, the next ``send_counts[1]`` to rank 1, and so on; the result
    holds ``recv_counts[j]`` elements from each rank j, in rank order. Without
    ``recv_counts`` the ranks first exchange their counts (an alltoall of N integers, which
    comm_counters and the flight recorder show as one more alltoall), as the DLRM and
    torchrec embedding exchanges do. Counts differ by rank, so a bad count raises on its
    rank only: under RAF_DIST_CHECK_COLLECTIVES the ranks compare them first."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = get_communicator().size if group is None else _native.func("group_size")(group)
    send_counts = np.ascontiguousarray(send_counts, dtype=np.int64).reshape(-1)
    if send_counts.size != size or (send_counts < 0).any() or send_counts.sum() != x.size:
        raise ValueError(f"alltoallv: send_counts {send_counts.tolist()} must give one "
                         f"non-negative count per rank ({size}) summing to the input's "
                         f"{x.size} elements")
    if recv_counts is None:
        recv_counts = alltoall(send_counts, group=group)
    recv_counts = np.ascontiguousarray(recv_counts, dtype=np.int64).reshape(-1)
    out = _output(out, x, int(recv_counts.sum()))
    args = (as_tensor(x, "input"), as_tensor(send_counts, "send_counts"),
            as_tensor(recv_counts, "recv_counts"), _group(group), as_tensor(out, "out"))
    return _run("alltoall", args, out, (x, out, send_counts, recv_counts), async_op)


def broadcast(x, root=0, async_op=False, group=None):
    """Overwrite ``x`` on every rank with rank ``root``'s ``x`` (in place)."""
    t = as_tensor(x, "buffer")
    return _run("broadcast", (t, root, _group(group), t), x, (x,), async_op)


def send(x, dst, async_op=False, group=None):
    """Send ``x`` to rank ``dst`` (matched by a ``recv`` there)."""
    return _run("send", (as_tensor(x, "buffer"), dst, _group(group)), None, (x,), async_op)


def recv(out, src, async_op=False, group=None):
    """Receive into ``out`` from rank ``src``."""
    return _run("recv", (src, _group(group), as_tensor(out, "out")), out, (out,), async_op)


def barrier(group=None):
    _native.func("barrier")(_group(group))


def comm_counters(group=None):
    """Traffic so far by collective kind: ``{kind: {"calls": int, "bus_bytes": float}}``.

    Without ``group``, this rank's traffic on every process group; with a native group id
    (e.g. ``dist.get_mesh().tp_group``), that group's traffic only.

    Bus bytes follow nccl-tests: allreduce 2(N-1)/N*S, reduce_scatter and allgather
    (N-1)/N*S (S = the full, unsharded buffer), alltoall (N-1)/N*S (S = this rank's input; an
    uneven alltoallv counts the elements it sends to the other ranks), broadcast/send/recv
    S, where N is the size of the group the collective ran on.
    """
    get_communicator()
    raw = _native.func("counters")() if group is None else _native.func("group_counters")(group)
    return {str(k): {"calls": int(v[0]), "bus_bytes": float(v[1])} for k, v in raw.items()}


def wait_request(request, what: str, cause: str, sleep_s: float = 0.0005) -> None:
    """Wait for an mpi4py request by polling, sleeping ``sleep_s`` between tests after the
    first hundred (MPICH's blocking waits spin, and a waiting rank must not take the core of
    the rank it waits for when ranks share a host), under RAF_DIST_COLLECTIVE_TIMEOUT_S: a
    peer that never comes raises TimeoutError naming ``what``, the likely ``cause`` and this
    rank's last collectives, instead of hanging."""
    import time

    from . import settings

    timeout = settings.collective_timeout_s()
    deadline = None if timeout is None else time.monotonic() + timeout
    polls = 0
    while not request.Test():
        polls += 1
        if polls > 100:
            time.sleep(sleep_s)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} did not complete within {timeout:g} s "
                    f"(RAF_DIST_COLLECTIVE_TIMEOUT_S); {cause}. This rank's last collectives "
                    f"(flight recorder):{recent_collectives() or ' (none yet)'}")


def recent_collectives() -> str:
    """The flight recorder: this process's last collectives (group, sequence number, kind,
    elements, age), one per line, oldest first; what a timeout error shows."""
    return str(_native.func("recent_collectives")())


def reset_comm_counters(group=None):
    """Zero the counters: all of them (the total and every group's), or with ``group`` that
    group's only (the total then still includes what the group sent before)."""
    get_communicator()
    if group is None:
        _native.func("reset_counters")()
    else:
        _native.func("reset_group_counters")(group)

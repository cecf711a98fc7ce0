"""The pipeline's messages (DESIGN.md section 3c), every one under the collective timeout,
counted, and recorded.

- Activations and gradients between stages: tagged asynchronous point-to-point messages on
  the pp axis (mpi4py's ``Isend`` / ``Irecv`` from host buffers; the tag names the
  microbatch, the stage boundary and the direction, so the order in which a schedule posts
  them never matters). Each is waited under RAF_DIST_COLLECTIVE_TIMEOUT_S; its bytes are
  counted (``sent_bytes``, ``stats()["comm_bytes_last_step"]["send"]``); the last messages
  are kept in this transport's own recorder, which a timeout error lists next to the native
  flight recorder. Why mpi4py and not the native send / recv: those match messages in
  posting order only (no tag), and a schedule's sends and receives between two ranks need
  not come in the same order on both.
- Control messages (the sum of tied gradients over their pp ranks, the loss broadcast from
  the last stage, the all-ranks finite check): raf_dist's native collectives on the mesh's
  groups, with their timeouts, byte counters and flight recorder like every other
  collective.
"""
import collections
import time
from typing import Any, Deque, Dict, List, Sequence, Tuple

import ml_dtypes
import numpy as np

from ..distributed import collectives

_RECORDED = 16  # messages the recorder keeps


def tag(kind: str, boundary: int, microbatch: int, num_stages: int) -> int:
    """The MPI tag of the message crossing ``boundary`` (between stages b and b + 1) for
    ``microbatch``: activations ("F") even, gradients ("B") odd."""
    return (microbatch * num_stages + boundary) * 2 + (1 if kind == "B" else 0)


class PipelineTransport:
    """The messages of this rank's pipeline schedule (module docstring)."""

    def __init__(self, mesh: Any, num_stages: int, microbatches: int) -> None:
        from mpi4py import MPI

        self.mesh, self.num_stages = mesh, num_stages
        limit = mesh.pp_comm.Get_attr(MPI.TAG_UB)
        if tag("B", num_stages, microbatches, num_stages) > limit:
            raise ValueError(f"{microbatches} microbatches x {num_stages} stages need more "
                             f"message tags than this MPI offers ({limit}); use fewer "
                             "microbatches")
        self.sent_bytes = 0
        self._recent: Deque[str] = collections.deque(maxlen=_RECORDED)
        self._sends: List[Tuple[Any, np.ndarray, str]] = []

    # ---- point to point -------------------------------------------------------------------
    def post_recv(self, buffer: np.ndarray, source: int, kind: str, boundary: int,
                  microbatch: int) -> Any:
        """Post the receive of a boundary message into ``buffer``; returns its request."""
        self._record("recv posted", kind, boundary, microbatch, source, buffer.nbytes)
        return self.mesh.pp_comm.Irecv(_wire(buffer), source=source,
                                       tag=tag(kind, boundary, microbatch, self.num_stages))

    def send(self, value: np.ndarray, dest: int, kind: str, boundary: int,
             microbatch: int) -> None:
        """Start sending ``value`` (kept alive until ``finish_sends``)."""
        request = self.mesh.pp_comm.Isend(_wire(value), dest=dest,
                                          tag=tag(kind, boundary, microbatch, self.num_stages))
        what = self._record("send", kind, boundary, microbatch, dest, value.nbytes)
        self._sends.append((request, value, what))
        self.sent_bytes += value.nbytes

    def wait(self, request: Any, what: str) -> None:
        """Wait for a message's request under the collective timeout (polling, so that a
        waiting rank keeps off the cores of the ranks it waits for)."""
        collectives.wait_request(
            request, f"pipeline message {what} (pp rank {self.mesh.pp_rank})",
            "the peer rank has probably died, stalled or runs a different schedule. This "
            f"rank's last pipeline messages:{self.recent() or ' (none)'}", sleep_s=0.0002)

    def finish_sends(self) -> None:
        """Wait for every send of the step, then start counting the next step's."""
        sends, self._sends = self._sends, []
        for request, _, what in sends:
            self.wait(request, what)

    def start_step(self) -> None:
        self.sent_bytes = 0

    def recent(self) -> str:
        """This rank's last pipeline messages, one per line, oldest first."""
        return "".join(f"\n  {line}" for line in self._recent)

    def _record(self, event: str, kind: str, boundary: int, microbatch: int, peer: int,
                size: int) -> str:
        what = (f"{event} {'activation' if kind == 'F' else 'gradient'} of microbatch "
                f"{microbatch} across boundary {boundary}, peer pp rank {peer}, {size} bytes")
        self._recent.append(f"{time.strftime('%H:%M:%S')} {what}")
        return what

    # ---- control messages (native collectives) -------------------------------------------
    def sum_tied(self, gradients: Dict[str, np.ndarray], tied: Sequence[str],
                 shapes: Dict[str, Tuple[Tuple[int, ...], str]]) -> Dict[str, np.ndarray]:
        """Every tied parameter's gradient summed over the pp ranks (ranks not holding one
        add zeros): one allreduce per tied parameter over the pp group, on every pp rank in
        the same order."""
        out = {}
        for name in tied:
            shape, dtype = shapes[name]
            host = (np.ascontiguousarray(gradients[name]) if name in gradients
                    else np.zeros(shape, dtype))
            summed = collectives.allreduce(host, group=self.mesh.pp_group)
            if name in gradients:
                out[name] = summed
        return out

    def broadcast_from_last_stage(self, value: float) -> float:
        """``value`` of the last pp rank, on every pp rank."""
        buffer = np.array([value], np.float64)
        collectives.broadcast(buffer, root=self.mesh.pp_size - 1, group=self.mesh.pp_group)
        return float(buffer[0])

    def dp_sum(self, value: float) -> float:
        """The sum of ``value`` over the gradient group (dp, or dp x cp)."""
        buffer = np.array([value], np.float64)
        if self.mesh.dp_size * self.mesh.cp_size > 1:
            buffer = collectives.allreduce(buffer, group=self.mesh.grad_group)
        return float(buffer[0])

    def all_ranks(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the world (an allreduce(min))."""
        buffer = np.array([1.0 if ok else 0.0], np.float32)
        return bool(collectives.allreduce(buffer, op="min")[0] == 1.0)

    def merge_over_pp(self, held: Dict[str, np.ndarray], holders: Dict[str, int],
                      names: Sequence[str]) -> Dict[str, np.ndarray]:
        """{name: array} for every name of ``names`` (in that order on every pp rank): rank
        ``holders[name]``'s value, broadcast over the pp group (a header with the shape and
        dtype first, so the other ranks need not know them). Every pp rank calls it."""
        out = {}
        for name in names:
            root = holders[name]
            # np.array, not ascontiguousarray: that makes a 0-d array 1-d
            value = np.array(held[name], order="C") if self.mesh.pp_rank == root else None
            header = np.full(_HEADER, -1, np.int64)
            if value is not None:
                if value.ndim > _HEADER - 1 or str(value.dtype) not in _DTYPES:
                    raise TypeError(f"{name}: {value.dtype} tensor of {value.ndim} dimensions "
                                    f"cannot be gathered over pp (dtypes {_DTYPES}, at most "
                                    f"{_HEADER - 1} dimensions)")
                header[0] = _DTYPES.index(str(value.dtype))
                header[1:1 + value.ndim] = value.shape
            collectives.broadcast(header, root=root, group=self.mesh.pp_group)
            if value is None:
                shape = tuple(int(d) for d in header[1:] if d >= 0)
                value = np.empty(shape, _DTYPES[int(header[0])])
            if value.size:
                collectives.broadcast(value.reshape(-1), root=root, group=self.mesh.pp_group)
            out[name] = value
        return out


# the header of merge_over_pp: dtype index, then up to 7 dimensions (-1: none)
_HEADER = 8
_DTYPES = ["float32", "float64", "float16", "int32", "int64"]


def _wire(array: np.ndarray) -> np.ndarray:
    """What MPI sends or receives for ``array``: its bits (uint16) when bfloat16 (a pipeline
    message under mixed precision), which mpi4py's buffer protocol does not take; the same
    memory either way."""
    return array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array

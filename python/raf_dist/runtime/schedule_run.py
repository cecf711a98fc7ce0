"""One step of this rank's pipeline schedule (DESIGN.md section 3c): the actions of
``training/pipeline_schedule.py`` executed on the compiled stages, the boundary messages on
the ``PipelineTransport``. The executor (runtime/pipeline_executor.py) owns the parameters, buffers
and the update; a ``ScheduleRun`` lives for one step and returns the weighted loss sum and
the accumulated gradients.

- every receive of the step is posted first, sends are waited at the end, so whatever order
  the schedule asks for nothing can deadlock on a message;
- ``F(s, m)`` runs stage s's forward on microbatch m and keeps what its backward needs (only
  the stage input under activation checkpointing); the last stage's forward gives the
  microbatch's mean loss, weighted by its share of the global batch;
- ``B(s, m)`` runs the backward with the gradient from stage s + 1 (on the last stage: the
  microbatch's loss weight) and adds the parameter gradients into the accumulators.

Under mixed precision a message may be in a 16-bit dtype (the boundary's spec; a stage
before the last returns its activation in it, runtime/pipeline_executor.py) while the next stage's
input is float32 (TVM's Gradient differentiates no bfloat16 input): the activation is
widened where it is consumed, and the input gradient a backward returns (float32) is
narrowed to the message dtype before it is sent or handed over.
"""
import time
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import tvm

from ..training import batch_size as batching
from .tensors import nbytes, numpy_dtype


class ScheduleRun:
    """This rank's actions for one step. ``sets``: the compiled stages by microbatch rows;
    ``pieces``: each microbatch's rows; ``weights``: each microbatch's loss weight;
    ``tensors`` / ``buffers``: the executor's parameters and stage buffers by name (a
    stage's forward writes its new buffer values into ``buffers``)."""

    def __init__(self, actions: Sequence[Any], transport: Any, sets: Dict[int, Any],
                 pieces: Sequence[int], weights: Sequence[float], tensors: Dict[str, Any],
                 buffers: Dict[str, Any], *, my_stages: Sequence[int], recompute: Iterable[int],
                 device: Any, dtype: str, recorder: Any = None) -> None:
        self.actions, self.transport, self.sets = actions, transport, sets
        self.pieces, self.weights = list(pieces), list(weights)
        self.tensors, self.buffers, self.my_stages = tensors, buffers, set(my_stages)
        # the stages that keep only their input and recompute in backward ("full")
        self.recompute, self.device, self.recorder = set(recompute), device, recorder
        self.starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(int).tolist()
        self.seeds = [tvm.runtime.tensor(np.array(w, dtype=dtype), device) for w in weights]
        self.handoff: Dict[Tuple[str, int, int], Any] = {}  # for this rank's next F / B
        self.outputs: Dict[Tuple[str, int, int], Any] = {}  # waiting for their SEND
        self.saved: Dict[Tuple[int, int], List[Any]] = {}  # (stage, m) -> saved tensors
        self.live = {s: 0 for s in my_stages}
        self.live_bytes = {s: 0 for s in my_stages}
        # the most microbatches (and bytes) of saved activations each stage held at once
        self.peak_saved = dict(self.live)
        self.peak_saved_bytes = dict(self.live_bytes)
        # bytes of boundary messages held (posted receive buffers, handoffs, outputs waiting
        # for their SEND, sent messages kept until the step's sends are waited), and the
        # most saved values + messages held at once, after any action (runtime/stage_budget.py
        # models both)
        self.boundary_bytes = 0
        self.peak_held_bytes = 0
        self.timeline: List[Tuple[str, int, int, float, float]] = []
        self.loss_sum = 0.0
        self.accs: Dict[str, Any] = {}

    def run(self, inputs: Sequence[np.ndarray], y: np.ndarray, target_per_row: int,
            param_names: Sequence[str], param_specs: Sequence[Any]) -> Tuple[float, dict]:
        """(weighted loss sum on the last stage, else 0; {parameter: accumulated gradient})."""
        self.accs = {n: tvm.runtime.tensor(np.zeros(s, d), self.device)
                     for n, (s, d) in zip(param_names, param_specs)}
        recvs = self._post_receives()
        self.boundary_bytes = sum(buffer.nbytes for _, buffer in recvs.values())
        self._note_held()
        self.transport.start_step()
        for a in self.actions:
            began = time.perf_counter()
            if a.kind in ("RECV_F", "RECV_B"):
                request, buffer = recvs.pop((a.kind, a.stage, a.microbatch))
                self.transport.wait(request, str(a))
                received = tvm.runtime.tensor(buffer, self.device)
                self.handoff[(a.kind[-1], a.stage, a.microbatch)] = received
                self.boundary_bytes += nbytes(received) - buffer.nbytes
            elif a.kind in ("SEND_F", "SEND_B"):
                value = self.outputs.pop((a.kind[-1], a.stage, a.microbatch))
                boundary = a.stage if a.kind == "SEND_F" else a.stage - 1
                _, dtype = self.sets[self.pieces[a.microbatch]].boundary_specs[boundary]
                host = value.numpy()  # (a message travels through the host)
                message = np.ascontiguousarray(host.astype(numpy_dtype(dtype), copy=False))
                self.boundary_bytes += message.nbytes - nbytes(value)  # kept until the end
                self.transport.send(message, a.peer, a.kind[-1], boundary, a.microbatch)
            elif a.kind == "F":
                self._forward(a.stage, a.microbatch, inputs, y, target_per_row)
            elif a.kind == "B":
                self._backward(a.stage, a.microbatch)
            if a.kind in ("F", "B"):
                self._record(a.kind, a.stage, a.microbatch, began, time.perf_counter())
            self._note_held()
        self.transport.finish_sends()
        self.boundary_bytes = 0
        return self.loss_sum, self.accs

    def _post_receives(self) -> Dict[Tuple[str, int, int], Tuple[Any, np.ndarray]]:
        """Every receive of the step, posted now, into buffers of the boundary's shape."""
        recvs = {}
        for a in self.actions:
            if a.kind not in ("RECV_F", "RECV_B"):
                continue
            specs = self.sets[self.pieces[a.microbatch]].boundary_specs
            boundary = a.stage - 1 if a.kind == "RECV_F" else a.stage
            shape, dtype = specs[boundary]
            buffer = np.empty(shape, dtype=numpy_dtype(dtype))
            request = self.transport.post_recv(buffer, a.peer, a.kind[-1], boundary,
                                               a.microbatch)
            recvs[(a.kind, a.stage, a.microbatch)] = (request, buffer)
        return recvs

    def _rows_of(self, array: np.ndarray, m: int, per_row: int = 1) -> Any:
        piece = batching.target_piece(array, self.starts[m], self.pieces[m], per_row)
        return tvm.runtime.tensor(np.ascontiguousarray(piece), self.device)

    def _forward(self, s: int, m: int, inputs: Sequence[np.ndarray], y: np.ndarray,
                 target_per_row: int) -> None:
        stage = self.sets[self.pieces[m]].stages[s]
        fns = stage.functions
        data = ([self._rows_of(v, m) for v in inputs] if s == 0
                else [self._as(self._take(("F", s, m)), fns.input_specs[0][1])])
        if fns.last:
            data.append(self._rows_of(y, m, target_per_row))
        params = [self.tensors[n] for n in fns.param_names]
        params += [self.buffers[n] for n in fns.buffer_names]
        written = fns.buffers_written
        if s in self.recompute:  # only the stage input is kept; backward recomputes the rest
            out = stage.vm["forward_only"](*data, *params)
            primary, first_new = (out[0], 1) if written else (out, 0)
            keep = data
        else:
            out = stage.vm["forward"](*data, *params)
            primary, first_new = out[0], 1 + fns.num_saved
            keep = [out[1 + i] for i in range(fns.num_saved)]
        for i, name in enumerate(written):  # once per microbatch, in order
            self.buffers[name] = out[first_new + i]
        self.saved[(s, m)] = keep
        self.live[s] += 1
        self.live_bytes[s] += sum(nbytes(t) for t in keep)
        self.peak_saved[s] = max(self.peak_saved[s], self.live[s])
        self.peak_saved_bytes[s] = max(self.peak_saved_bytes[s], self.live_bytes[s])
        if fns.last:
            self.loss_sum += self.weights[m] * float(primary.numpy())
        else:
            self._deliver("F", s + 1, m, primary, s)

    def _backward(self, s: int, m: int) -> None:
        stage = self.sets[self.pieces[m]].stages[s]
        fns = stage.functions
        keep = self.saved.pop((s, m))
        self.live[s] -= 1
        self.live_bytes[s] -= sum(nbytes(t) for t in keep)
        grad_in = (self.seeds[m] if fns.last
                   else self._as(self._take(("B", s, m)), fns.seed_spec[1]))
        params = [self.tensors[n] for n in fns.param_names]
        if s in self.recompute:  # recompute reads the buffers too
            params += [self.buffers[n] for n in fns.buffer_names]
        mine = [self.accs[n] for n in fns.trainable]
        function = "recompute" if s in self.recompute else "backward"
        out = stage.vm[function](*keep, grad_in, *params, *mine)
        for i, n in enumerate(fns.trainable):
            self.accs[n] = out[1 + i]
        if s > 0:
            self._deliver("B", s - 1, m, out[0], s)

    def _take(self, key: Tuple[str, int, int]) -> Any:
        """The handoff ``key`` (a received message or this rank's stage's output), let go."""
        tensor = self.handoff.pop(key)
        self.boundary_bytes -= nbytes(tensor)
        return tensor

    def _note_held(self) -> None:
        held = sum(self.live_bytes.values()) + self.boundary_bytes
        self.peak_held_bytes = max(self.peak_held_bytes, held)

    def _as(self, tensor: Any, dtype: str) -> Any:
        """``tensor`` in ``dtype``: a 16-bit message widened for a float32 stage input, a
        float32 input gradient narrowed to the dy a 16-bit stage output takes."""
        if str(tensor.dtype) == dtype:
            return tensor
        return tvm.runtime.tensor(tensor.numpy().astype(numpy_dtype(dtype)), self.device)

    def _deliver(self, kind: str, to_stage: int, m: int, tensor: Any, from_stage: int) -> None:
        """A stage's output for ``to_stage``: handed over when this rank holds it, else kept
        for the SEND action that follows."""
        if to_stage in self.my_stages:
            self.handoff[(kind, to_stage, m)] = tensor
        else:
            self.outputs[(kind, from_stage, m)] = tensor
        self.boundary_bytes += nbytes(tensor)

    def _record(self, kind: str, s: int, m: int, began: float, ended: float) -> None:
        self.timeline.append((kind, s, m, began, ended))
        if self.recorder is not None:
            self.recorder.add(f"{kind} stage {s} mb {m}", "pipeline", int(began * 1e9),
                              int(ended * 1e9), stage=s, microbatch=m)


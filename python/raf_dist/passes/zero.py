"""ShardZeRO: ZeRO-1/2/3 as one distribution pass over the training step (DESIGN.md section 3).

Input: ``train_step`` as ``training.build_train_step`` emits it: one dataflow block (forward,
loss, backward with gradient markers, then the optimizer's elementwise update) and the layout
attributes saying which arguments are parameters and optimizer states.
Arguments: ``level`` (1–3), ``world_size`` N, ``bucket_bytes``, ``overlap``, ``group``.
Analysis, then rewrite: ``zero_plan.plan_zero`` reads and checks the step and decides the
buckets, the state layout, the update chains and level 3's gathers; ``_Emitter`` here emits
the bindings that plan describes, in the order below.

Sharding. Every tensor of n elements is cut into N flat, padded dim-0 shards of
s = ceil(n / N) elements; rank r owns elements [r*s, (r+1)*s) of the flattened tensor, the
tail past n being zeros. A bucket's shards live back to back in one [S] buffer (S = sum of the
tensors' s). A bucket is exchanged where its tensors live, with no packed copy of it:
``reduce_scatter(g_1, ..., g_k, "avg", group, shards)`` reads every gradient in its own buffer
and leaves this rank's [S] shards; ``allgather(shards, group, p_1, ..., p_k)`` writes every
updated tensor straight into its parameter's buffer, as DeepSpeed's flat buffers do (one
collective call per bucket either way). Nothing in the IR names a rank: the collectives pick
the shard at run time, and ``raf_dist.ccl.local_shard`` cuts this rank's shard of a full
parameter. The IR is the same on every rank.

What each level emits (gradients averaged in the reduce_scatter; loss averaged as in DP):
  1  optimizer state arguments become one flat [S] shard per gradient bucket and state
     (bucket-major: the layout ``state_layout`` describes); after backward, every gradient bucket is
     reduce-scattered; each rank updates its parameter shard (cut by local_shard) and its
     state shard; the updated shards are all-gathered per bucket into the parameters, in
     place (the step returns the parameter arguments themselves). Planned temporaries: level
     0's (every full gradient is alive when backward ends) plus the [S] shards.
  2  as 1, but each bucket is reduce-scattered as soon as its last gradient exists; with
     overlap the collective runs while backward continues and is waited on (and the bucket's
     shards updated) when the next bucket is complete, before that one's reduce_scatter
     starts, so the planner sees each bucket's gradients die at their reduce_scatter. The
     updated shards are all-gathered into the parameters once backward is done (as DeepSpeed
     does): backward may still read a parameter after its bucket's gradients exist.
  3  as 2, and parameters themselves are shard arguments: parameters are gathered in buckets
     (forward order) just before their first forward use, each straight into a full buffer
     of its own (``allgather(shards, group, full_1, ..., full_k)``), the next bucket's gather
     started one ahead; the gathered tensors die after their last forward use; backward
     gathers the parameters it reads again, in backward order; the update outputs shards.
     Under mixed precision a parameter read only as its 16-bit copy is gathered as that copy
     (each shard cast first, buckets of one dtype): half the allgather bytes.
The optimizer region must be elementwise (SGD, Adam, AdamW are): it is re-emitted on shards.

Local parameters (``raf_dist.local_params``: embedding tables sharded over the same dp
ranks, whose gradients are each rank's own) have no marker and are no bucket's: they stay
whole arguments (level 3 too), are never gathered, and their update chains (dense, or the
looked-up rows in place) are emitted as build_train_step wrote them, after the buckets'
updates; their states follow the buckets' flat ones (raf_dist.layout).

``guard=True`` (Trainer(nonfinite="skip") under ZeRO): no bucket is updated before every
gradient is reduced; each rank then checks its gradient shards and its loss (sums, as
training/nonfinite.py), the ranks sum their "not finite" verdicts (one float allreduce), and
every update becomes ``where(all finite, new, old)``, the loss NaN otherwise, so a
non-finite step leaves parameters and state as they were on every rank. The updates then no
longer overlap backward's reductions (only with the guard). The verdict shares its allreduce
with clipping's sums of squares (passes/zero_agreement.py). The local parameters' gradients
join the verdict too, and their updates are kept the same way (passes/zero_local.py, with
their part of clipping).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import tvm
from tvm import relax

from . import clipping

from .bucketing import Segments, assemble, collective
from .gradient_markers import UPDATED_ARGUMENTS, substitute
from .zero_agreement import agree
from .zero_local import LocalChains
from .zero_plan import Bucket, GatherRegion, ZeroPlan, low_cast, plan_zero

Handle = Optional[relax.Var]  # a started collective's handle; None: it ran blocking


class _Emitter:
    """Emits the sharded step a ``ZeroPlan`` describes (passes/zero_plan.py decides, this
    follows), binding by binding in the order the module docstring gives; the collectives
    still in flight and the updated values found so far are its state."""

    def __init__(self, plan: ZeroPlan, overlap: bool, group: int, guard: bool,
                 clip: Optional[clipping.Clip] = None):
        self.plan, self.step = plan, plan.step
        self.overlap, self.guard, self.clip = overlap, guard, clip
        # the guard and clipping both need every gradient reduced before any update
        self.waits_all = guard or clip is not None
        self.group = relax.prim_value(group)
        self.seg = Segments()
        self.loss = self.step.loss  # the guard replaces it: NaN unless every rank is finite
        self.all_finite: Optional[relax.Var] = None  # guard: every rank's verdict
        # reduce_scatters: bucket index -> (bucket, handle, gradients, out)
        self.in_flight: Dict[int, Tuple[Bucket, Handle, List[relax.Expr], relax.Var]] = {}
        # guarded: (bucket, reduced shard) until every rank's verdict is known
        self.pending: List[Tuple[Bucket, relax.Var]] = []
        # allgathers of updated shards: (bucket, handle, updated shards)
        self.gathering: List[Tuple[Bucket, Handle, relax.Var]] = []
        self.deferred: List[Tuple[Bucket, relax.Var]] = []  # level 2: gathered after backward
        self.new_full: Dict[int, relax.Var] = {}  # parameter -> its updated value (levels 1-2)
        self.new_param_shards: Dict[int, relax.Var] = {}  # parameter -> updated shard (level 3)
        self.new_states: Dict[Tuple[int, int], relax.Var] = {}  # (bucket, state slot) -> updated
        # level 3, per (region, bucket): the started gather, then the gathered parameters
        self.started: Dict[Tuple[str, int], Tuple[Handle, relax.Var, List[relax.Var]]] = {}
        self.gathered: Dict[Tuple[str, int], Dict[int, relax.Var]] = {}
        self.local = LocalChains(self)  # the local parameters' chains

    def emit(self) -> relax.Function:
        if self.plan.forward_gathers is not None:
            self._prefetch(self.plan.forward_gathers, 0)
        for binding in self.plan.update.shared:  # scalar-only work of the optimizer
            self.seg.add(binding)
        self._forward_and_backward()
        self._after_backward()
        return self._assemble()

    # ---- building blocks ------------------------------------------------------------------
    def bind(self, name: str, value: relax.Expr, dataflow: bool = True) -> relax.Var:
        return self.seg.bind(name, value, dataflow)

    def alloc(self, name: str, numel: int, dtype: str) -> relax.Var:
        return self.bind(name, relax.op.builtin.alloc_tensor(relax.ShapeExpr([numel]), dtype,
                                                             relax.prim_value(0)))

    def split_shards(self, name: str, bucket: Bucket, packed: relax.Var,
                     dataflow: bool = True) -> List[relax.Var]:
        """Per-tensor shards [s_i] of a packed [S] shard buffer."""
        if len(bucket.keys) == 1:
            return [packed]
        parts = self.bind(f"{name}_parts", relax.op.split(packed, bucket.split_offsets, axis=0),
                          dataflow)
        return [self.bind(f"{name}_shard{key}", relax.TupleGetItem(parts, i), dataflow)
                for i, key in enumerate(bucket.keys)]

    def concat_shards(self, name: str, shards: Sequence[relax.Var], copy: bool = False
                      ) -> relax.Var:
        """Per-parameter 1-D shards into one flat buffer. ``copy``: by one copy per tensor
        (``raf_dist.bucket.concat``, src/ccl/bucket.cc) for a buffer a collective reads, where
        TVM's ``concat`` kernel walks a k-way select chain per element (6 ms for 54 shards,
        1.9 MB, on this CPU); else TVM's ``concat``, which the update's elementwise chain fuses
        with (the kernel reads the shards where they are: no [S] copy beside the update's
        buffers, which ZeRO-3's memory is about, at the chain's cost in time)."""
        if len(shards) == 1:
            return shards[0]
        if not copy:
            return self.bind(name, relax.op.concat(shards, axis=0))
        ty = shards[0].ty
        total = sum(int(s.ty.shape[0]) for s in shards)
        return self.bind(name, relax.call_dps_packed(
            "raf_dist.bucket.concat", list(shards), relax.TensorType([total], ty.dtype)))

    def start(self, kind: str, name: str, sends: Sequence[relax.Expr],
              outs: Sequence[relax.Expr]) -> Handle:
        """Blocking collective (overlap off) or start; returns the handle or None.
        reduce_scatter: several full inputs, one [S] shard output; allgather: one shard
        input, one or several full outputs (src/ccl/collective.h)."""
        avg = [tvm.ir.StringImm("avg")] if kind == "reduce_scatter" else []
        args = [*sends, *avg, self.group, *outs]
        if not self.overlap:
            self.bind(name, collective(f"raf_dist.ccl.{kind}", *args), dataflow=False)
            return None
        return self.bind(f"{name}_handle", collective(f"raf_dist.ccl.{kind}_start", *args),
                         dataflow=False)

    def wait(self, name: str, handle: Handle, *buffers: relax.Expr) -> None:
        if handle is not None:
            self.bind(name, collective("raf_dist.ccl.wait", handle, *buffers), dataflow=False)

    # ---- the step, in order ---------------------------------------------------------------
    def _forward_and_backward(self) -> None:
        """The step's bindings before the optimizer, the gradient markers dropped; levels 2-3
        reduce each bucket as soon as it is complete."""
        plan, step = self.plan, self.step
        marker_positions = {m.position for m in step.markers}
        for pos, binding in enumerate(step.bindings[:step.optimizer_begin]):
            if plan.backward_gathers is not None and pos == step.forward_end + 1:
                self._prefetch(plan.backward_gathers, 0)
            if pos in marker_positions:
                if pos in plan.closes and plan.level >= 2:
                    # the previous bucket's reduce_scatter has had a whole bucket of backward
                    # to finish: wait for it (and update its shards) before packing this
                    # bucket, so one packed bucket at a time is alive
                    self._finish_reduces(keep=0)
                    self._reduce_scatter(plan.closes[pos])
                continue
            self.seg.add(relax.VarBinding(binding.var, self._read_gathered(pos, binding.value)))

    def _after_backward(self) -> None:
        """What is left once backward is done: level 1's reductions, the guard's verdict and
        its updates, level 2's gathers of the updated shards, every wait."""
        for binding in self.plan.update.tail:  # e.g. the accumulated loss
            self.seg.add(binding)
        if self.plan.level == 1:  # after backward: every bucket, one after the other
            for bucket in self.plan.grad_buckets:
                self._reduce_scatter(bucket)
                self._finish_reduces(keep=1 if self.overlap else 0)
        self._finish_reduces(keep=0)
        coef = None
        if self.waits_all:  # every rank's verdict / norm first, then the updates
            self.all_finite, self.loss, coef = agree(self, self.pending)
            for bucket, out in self.pending:
                if coef is not None:
                    out = clipping.scaled(self.seg.builder, out, coef,
                                          emit=self.binder(f"clipped{bucket.index}"))
                self._update(bucket, out)
        for bucket, new_param in self.deferred:
            self._gather_updated(bucket, new_param)
        self._finish_gathers(keep=0)
        self.local.emit(coef)  # this rank's own tables (passes/zero_local.py)

    def _outputs(self) -> List[relax.Expr]:
        """(loss, params, states, buffers), parameters and states in their new layout (the
        local parameters' whole, after the buckets')."""
        plan, step = self.plan, self.step
        new_params = dict(self.new_param_shards if plan.level == 3 else self.new_full)
        new_params.update({k: self.local.new_param(k) for k in step.local})
        return ([self.loss] + [new_params[k] for k in range(len(step.params))]
                + [self.new_states[(b.index, j)] for b in plan.grad_buckets
                   for j in range(step.per_param)]
                + [self.local.new_state(k, j) for k in step.local
                   for j in range(step.per_param)]
                + list(step.buffer_outputs))

    def _assemble(self) -> relax.Function:
        plan, step = self.plan, self.step
        fields = self._outputs()
        self.bind("allreduce_loss", collective("raf_dist.ccl.allreduce", self.loss,
                                               tvm.ir.StringImm("avg"), self.group, self.loss),
                  dataflow=False)
        output = self.bind("step_outputs", relax.Tuple(fields), dataflow=False)
        func_params = list(step.func.params)
        offset, n_params = step.offset, len(step.params)
        func_params[offset:offset + n_params] = plan.new_params
        func_params[offset + n_params:offset + n_params + len(step.states)] = plan.state_arguments
        func = assemble(step.func, self.seg.segments, output, params=func_params,
                        ret_ty=output.ty)
        # outputs 1.. still replace the parameter and state arguments, in their new layout
        n_core = len(fields) - 1 - len(step.buffer_outputs)
        # the buffers stay the last arguments; the state arguments before them changed count
        shift = len(func_params) - len(step.func.params)
        return func.with_attr(UPDATED_ARGUMENTS, list(range(offset, offset + n_core))
                              + [i + shift for i in step.buffer_arguments])

    # ---- gradient buckets -----------------------------------------------------------------
    def _reduce_scatter(self, bucket: Bucket) -> None:
        """Start reducing a bucket's gradients, read where backward computed them (no packed
        copy: the planner keeps each alive until the wait, which names it)."""
        grads = [self.step.marker_of[k].grad for k in bucket.keys]
        # the gradients' dtype, which is not the parameters' when they travel in bfloat16
        # (Trainer(grad_reduce_dtype=...): the update chain starts with the cast back)
        out = self.alloc(f"grad_shard{bucket.index}", bucket.shard_total,
                          str(grads[0].ty.dtype))
        handle = self.start("reduce_scatter", f"reduce_scatter{bucket.index}", grads, [out])
        self.in_flight[bucket.index] = (bucket, handle, grads, out)

    def _finish_reduces(self, keep: int) -> None:
        """Wait for every reduce_scatter in flight but the last ``keep``, oldest first."""
        for index in list(self.in_flight)[:max(0, len(self.in_flight) - keep)]:
            bucket, handle, grads, out = self.in_flight.pop(index)
            self.wait(f"wait_reduce_scatter{index}", handle, *grads, out)
            if self.waits_all:
                self.pending.append((bucket, out))
            else:
                self._update(bucket, out)  # the reduced shard dies right here

    def _update(self, bucket: Bucket, grad_shard: relax.Var) -> None:
        """The optimizer on one bucket's flat shards, then the updated parameter shards put
        where the level keeps them."""
        b, step = bucket.index, self.step
        param_flat = self._param_shard(bucket)
        mapping = self._run_chain(bucket, param_flat, grad_shard)
        k0 = bucket.keys[0]
        new_param = mapping.get(step.new_param_field(k0), param_flat)
        old_states = [self.plan.flat_states[(b, j)] for j in range(step.per_param)]
        new_states = [mapping.get(step.new_state_field(k0, j), old)
                      for j, old in enumerate(old_states)]
        if self.guard:
            new_param = self.keep_if_finite(f"kept_param{b}", new_param, param_flat)
            new_states = [self.keep_if_finite(f"kept_state{b}_{j}", new, old)
                          for j, (new, old) in enumerate(zip(new_states, old_states))]
        self.new_states.update({(b, j): state for j, state in enumerate(new_states)})
        self._put_back(bucket, new_param)

    def _param_shard(self, bucket: Bucket) -> relax.Var:
        """This rank's [S] shard of the bucket's parameters."""
        keys = bucket.keys
        if self.plan.level == 3:
            return self.concat_shards(f"param_shards{bucket.index}",
                                      [self.plan.new_params[k] for k in keys])
        # cut from the full parameters at run time
        return self.bind(f"param_shard{bucket.index}", relax.call_dps_packed(
            "raf_dist.ccl.local_shard", [self.step.params[k] for k in keys] + [self.group],
            relax.TensorType([bucket.shard_total], bucket.dtype)))

    def _run_chain(self, bucket: Bucket, param_flat: relax.Var,
                   grad_shard: relax.Var) -> Dict[relax.Var, relax.Var]:
        """Parameter k0's update chain (the bucket's first parameter) re-emitted on [S]
        buffers; every parameter's chain is the same computation (zero_plan checks), so one
        elementwise pass updates the whole bucket. Returns what each of k0's variables became."""
        step, b, k0 = self.step, bucket.index, bucket.keys[0]
        mapping = {step.params[k0]: param_flat, step.marker_of[k0].var: grad_shard}
        for j in range(step.per_param):
            mapping[step.state(k0, j)] = self.plan.flat_states[(b, j)]
        for binding in self.plan.update.chains[k0]:
            value = self.seg.builder.normalize(substitute(binding.value, mapping))
            var = relax.DataflowVar(f"{binding.var.name}_b{b}", value.ty)
            self.seg.add(relax.VarBinding(var, value))
            mapping[binding.var] = var
        return mapping

    def keep_if_finite(self, name: str, new: relax.Var, old: relax.Var) -> relax.Var:
        return self.bind(name, relax.op.where(self.all_finite, new, old))

    def _put_back(self, bucket: Bucket, new_param: relax.Var) -> None:
        if self.plan.level == 3:
            # the split stays outside the dataflow block, so FuseOps keeps it out of the
            # update's kernel: alone it reads only the updated [S] shards, and each piece
            # can be written into its parameter's buffer (compiler.UpdateInPlace); fused,
            # every piece's block read every parameter of the bucket
            pieces = self.split_shards(f"new_param{bucket.index}", bucket, new_param,
                                       dataflow=False)
            self.new_param_shards.update(zip(bucket.keys, pieces))
        elif self.plan.level == 2:  # backward may still read the parameters: gather after it
            self.deferred.append((bucket, new_param))
        else:
            self._gather_updated(bucket, new_param)

    def _gather_updated(self, bucket: Bucket, new_param: relax.Var) -> None:
        """Allgather a bucket's updated shards straight into its parameters' buffers (no
        gathered copy of the bucket, no unpacking): level 1 while the next bucket is
        updated, level 2 after backward, one gather in flight behind the next."""
        targets = [self.step.params[k] for k in bucket.keys]
        handle = self.start("allgather", f"allgather_updated{bucket.index}", [new_param],
                            targets)
        self.gathering.append((bucket, handle, new_param))
        self._finish_gathers(keep=1 if self.overlap else 0)

    def _finish_gathers(self, keep: int) -> None:
        while len(self.gathering) > keep:
            bucket, handle, new_param = self.gathering.pop(0)
            targets = [self.step.params[k] for k in bucket.keys]
            self.wait(f"wait_allgather_updated{bucket.index}", handle, new_param, *targets)
            self.new_full.update(zip(bucket.keys, targets))  # updated in place

    def binder(self, prefix: str):
        """An ``emit`` for passes/clipping.py: binds each value under a fresh name."""
        count = [0]

        def emit(value: relax.Expr) -> relax.Var:
            count[0] += 1
            return self.bind(f"{prefix}_{count[0]}", value)

        return emit

    # ---- level 3: parameters gathered before use ------------------------------------------
    def _read_gathered(self, pos: int, value: relax.Expr) -> relax.Expr:
        """Level 3: ``value`` (binding ``pos``) reading the gathered parameters instead of
        their shards; unchanged at levels 1-2."""
        if self.plan.level != 3:
            return value
        region = self.plan.gathers_at(pos)
        cast = low_cast(value, region.param_index)
        if cast is not None and region.bucket_of[cast[0]].dtype == cast[1]:
            return self._gathered(region, cast[0])  # gathered as its 16-bit copy
        used = [v for v in relax.analysis.free_vars(value) if v in region.param_index]
        if not used:
            return value
        return substitute(value, {v: self._gathered(region, region.param_index[v])
                                   for v in used})

    def _start_gather(self, region: GatherRegion, b: int) -> None:
        bucket = region.buckets[b]
        name = f"{region.name}_gather{b}"
        shards = [self.plan.new_params[k] for k in bucket.keys]
        if bucket.dtype != str(shards[0].ty.dtype):  # a 16-bit gather: each shard cast first
            shards = [self.bind(f"{name}_low{k}", relax.op.astype(shard, bucket.dtype))
                      for k, shard in zip(bucket.keys, shards)]
        packed = self.concat_shards(f"{name}_shards", shards, copy=True)
        # every parameter gathered straight into a full buffer of its own shape, which the
        # forward (backward) then reads: no [N*S] gathered bucket to unpack by copies
        outs = [self.bind(f"{name}_full{k}", relax.op.builtin.alloc_tensor(
            relax.ShapeExpr([int(d) for d in ty.shape]), bucket.dtype, relax.prim_value(0)))
            for k, ty in zip(bucket.keys, bucket.types)]
        self.started[(region.name, b)] = (self.start("allgather", name, [packed], outs), packed,
                                          outs)

    def _prefetch(self, region: GatherRegion, b: int) -> None:
        """With overlap, start bucket b's gather ahead of its first use."""
        if self.overlap and b < len(region.buckets) and (region.name, b) not in self.started:
            self._start_gather(region, b)

    def _gathered(self, region: GatherRegion, k: int) -> relax.Var:
        """The full value of parameter k in this region: gathered (with its bucket) on first
        use."""
        bucket = region.bucket_of[k]
        key = (region.name, bucket.index)
        if key not in self.gathered:
            if key not in self.started:
                self._start_gather(region, bucket.index)
            handle, packed, outs = self.started[key]
            self.wait(f"wait_{region.name}_gather{bucket.index}", handle, packed, *outs)
            self._prefetch(region, bucket.index + 1)  # the next bucket, one ahead
            self.gathered[key] = dict(zip(bucket.keys, outs))
        return self.gathered[key][k]


@tvm.transform.module_pass(opt_level=0, name="ShardZeRO")
class ShardZeRO:
    """See the module docstring."""

    def __init__(self, level: int, world_size: int, bucket_bytes: int, overlap: bool = True,
                 group: int = 0, func_name: str = "train_step", guard: bool = False,
                 clip: Optional[clipping.Clip] = None):
        if level not in (1, 2, 3):
            raise ValueError(f"ShardZeRO level must be 1, 2 or 3, got {level!r} (level 0 is "
                             "AllReduceGradients)")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.level, self.world_size = int(level), int(world_size)
        self.bucket_bytes, self.overlap = int(bucket_bytes), bool(overlap)
        self.group, self.func_name, self.guard = int(group), func_name, bool(guard)
        self.clip = clip

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # every check of the step happens in the plan, before anything is emitted
        plan = plan_zero(mod[self.func_name], self.level, self.world_size, self.bucket_bytes)
        func = _Emitter(plan, self.overlap, self.group, self.guard, self.clip).emit()
        # parameters (level 3) and optimizer states are now held as ShardZeRO lays them out
        func = func.with_attr("raf_dist.zero_level", self.level)
        mod = mod.__class__(dict(mod.functions_items()))
        mod[self.func_name] = func
        return relax.transform.Normalize()(mod)

"""ShardZeRO: ZeRO-1/2/3 as one distribution pass over the training step (DESIGN.md section 3).

Input: ``train_step`` as ``training.build_train_step`` emits it: one dataflow block (forward,
loss, backward with gradient markers, then the optimizer's elementwise update) and the layout
attributes saying which arguments are parameters and optimizer states.
Arguments: ``level`` (1–3), ``world_size`` N, ``bucket_bytes``, ``overlap``, ``group``.

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
The optimizer region must be elementwise (SGD, Adam, AdamW are): it is re-emitted on shards.

``guard=True`` (Trainer(nonfinite="skip") under ZeRO): no bucket is updated before every
gradient is reduced; each rank then checks its gradient shards and its loss (sums, as
training/nonfinite.py), the ranks sum their "not finite" verdicts (one float allreduce), and
every update becomes ``where(all finite, new, old)``, the loss NaN otherwise, so a
non-finite step leaves parameters and state as they were on every rank. The updates then no
longer overlap backward's reductions (only with the guard).
"""
import tvm
from tvm import relax

from ..layout import shard_size, state_layout
from .bucketing import Segments, assemble, assign_buckets, collective, marker_buckets
from .gradient_markers import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                               UPDATED_ARGUMENTS, SubstituteVars, find_markers, tensor_numel)

ELEMENTWISE_OPS = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "sqrt", "rsqrt", "negative", "power", "maximum",
    "minimum", "abs", "sign", "exp", "log", "square", "where", "greater", "less",
    "greater_equal", "less_equal", "clip", "astype", "floor_divide"))


def _nbytes(ty):
    return tensor_numel(ty) * tvm.DataType(ty.dtype).bits // 8


class _Bucket:
    """Tensors exchanged together: their full types, shard sizes and packed sizes."""

    def __init__(self, index, keys, types, world_size):
        self.index = index
        self.keys = list(keys)  # parameter indices
        self.types = list(types)
        self.numels = [tensor_numel(t) for t in types]
        self.shards = [shard_size(n, world_size) for n in self.numels]
        self.shard_total = sum(self.shards)
        self.dtype = str(types[0].dtype)

    @property
    def split_offsets(self):
        """Where each tensor's shard starts in a packed [S] buffer, after the first."""
        offsets, total = [], 0
        for s in self.shards[:-1]:
            total += s
            offsets.append(total)
        return offsets


class _Rewriter:
    def __init__(self, func, level, world_size, bucket_bytes, overlap, group, guard=False):
        self.func, self.level, self.n, self.guard = func, level, world_size, guard
        self.bucket_bytes, self.overlap = bucket_bytes, overlap
        self.group = relax.prim_value(group)
        self.seg = Segments()
        self._check_and_parse()

    # ---- reading the step -----------------------------------------------------------------
    def _check_and_parse(self):
        func = self.func
        body = func.body
        if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
            raise ValueError("ShardZeRO expects train_step with one dataflow block, as "
                             "build_train_step emits it; run it before other block-splitting passes")
        attrs = func.attrs or {}
        if LAYOUT_PARAM_OFFSET not in attrs:
            raise ValueError("ShardZeRO needs train_step's layout attributes "
                             f"({LAYOUT_PARAM_OFFSET}, ...), which build_train_step sets")
        offset = int(attrs[LAYOUT_PARAM_OFFSET])
        num_params = int(attrs[LAYOUT_NUM_PARAMS])
        per_param = int(attrs[LAYOUT_STATES_PER_PARAM])
        self.params = list(func.params[offset:offset + num_params])
        self.states = list(func.params[offset + num_params:offset + num_params * (1 + per_param)])
        self.per_param = per_param
        self.block = body.blocks[0]
        self.bindings = list(self.block.bindings)
        self.position = {b.var: i for i, b in enumerate(self.bindings)}
        self.markers = find_markers(self.block)
        if sorted(m.param_index for m in self.markers) != list(range(num_params)):
            raise ValueError("ShardZeRO: every parameter needs exactly one gradient marker")
        bound = {b.var: b.value for b in self.bindings}
        self.output_var = body.body
        result = bound.get(self.output_var)
        n_core = 1 + num_params * (1 + per_param)
        if not isinstance(result, relax.Tuple) or len(result.fields) < n_core:
            raise ValueError("ShardZeRO: train_step must return (loss, *params, *states, "
                             "*buffers)")
        # buffers the forward updates (BatchNorm running statistics): replicated, passed through
        self.buffer_outputs = list(result.fields[n_core:])
        updated = [int(i) for i in attrs[UPDATED_ARGUMENTS]] if UPDATED_ARGUMENTS in attrs else []
        self.buffer_arguments = updated[len(updated) - len(self.buffer_outputs):] if (
            self.buffer_outputs) else []
        self.result = result
        self.loss = result.fields[0]
        self.forward_end = self.position.get(self.loss, -1)  # bindings <= this: forward + loss
        self.optimizer_begin = max(m.position for m in self.markers) + 1 if self.markers else 0
        for i in range(self.optimizer_begin, len(self.bindings)):
            binding = self.bindings[i]
            if binding.var.same_as(self.output_var) or isinstance(binding.value, relax.Var):
                continue
            value = binding.value
            if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    and value.op.name in ELEMENTWISE_OPS):
                what = value.op.name if isinstance(value, relax.Call) and isinstance(
                    value.op, tvm.ir.Op) else type(value).__name__
                raise ValueError(f"ShardZeRO: the optimizer update must be elementwise to run on "
                                 f"shards; {binding.var.name} is computed by {what}")

    # ---- building blocks ------------------------------------------------------------------
    def bind(self, name, value, dataflow=True):
        return self.seg.bind(name, value, dataflow)

    def _alloc(self, name, numel, dtype):
        return self.bind(name, relax.op.builtin.alloc_tensor(relax.ShapeExpr([numel]), dtype,
                                                             relax.prim_value(0)))

    def split_shards(self, name, bucket, packed, dataflow=True):
        """Per-tensor shards [s_i] of a packed [S] shard buffer."""
        if len(bucket.keys) == 1:
            return [packed]
        parts = self.bind(f"{name}_parts", relax.op.split(packed, bucket.split_offsets, axis=0),
                          dataflow)
        return [self.bind(f"{name}_shard{key}", relax.TupleGetItem(parts, i), dataflow)
                for i, key in enumerate(bucket.keys)]

    def concat_shards(self, name, shards):
        return shards[0] if len(shards) == 1 else self.bind(name, relax.op.concat(shards, axis=0))

    def start(self, kind, name, sends, outs):
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

    def wait(self, name, handle, *buffers):
        if handle is not None:
            self.bind(name, collective("raf_dist.ccl.wait", handle, *buffers), dataflow=False)

    # ---- the rewrite ----------------------------------------------------------------------
    def run(self):
        level, n, per_param = self.level, self.n, self.per_param
        params, states = self.params, self.states
        marker_by_pos = {m.position: m for m in self.markers}
        marker_pos = {m.param_index: m.position for m in self.markers}
        grads = {m.param_index: m.grad for m in self.markers}
        marker_var = {m.param_index: m.var for m in self.markers}
        chains, shared = self._update_chains(marker_var)

        # gradient buckets, in backward order
        grad_buckets = [_Bucket(b, keys, [params[k].ty for k in keys], n) for b, keys in
                        enumerate(marker_buckets(self.markers, self.bucket_bytes))]

        # new arguments: parameter shards (level 3); optimizer state as one flat [S] shard
        # per bucket and state (bucket-major), the layout the update runs on, so no copy
        # gathers or scatters it around each step: raf_dist.layout's StateLayout, which the
        # executors, checkpoints and stats read too
        layout = state_layout([str(i) for i in range(len(params))],
                              [([int(d) for d in p.ty.shape], str(p.ty.dtype)) for p in params],
                              [str(j) for j in range(per_param)], level, n, 0,
                              [b.keys for b in grad_buckets])

        def shard_var(i, var):
            return relax.Var(var.name, relax.TensorType([layout.shard_numel(i)], var.ty.dtype))
        new_params = ([shard_var(i, p) for i, p in enumerate(params)] if layout.params_sharded
                      else list(params))
        flat_states = {}
        for buffer in layout.state_buffers():
            j = int(buffer.state)
            name = states[buffer.params[0] * per_param + j].name
            suffix = name.rsplit("__", 1)[-1] if "__" in name else f"state{j}"
            flat_states[(buffer.bucket, j)] = relax.Var(
                f"bucket{buffer.bucket}__{suffix}", relax.TensorType([buffer.numel], buffer.dtype))
        closes = {marker_pos[b.keys[-1]]: b for b in grad_buckets}

        in_flight = {}  # reduce_scatters: bucket index -> (bucket, handle, gradients, out)
        gathering = []  # allgathers of updated shards: (bucket, handle, updated shards)
        full = {}  # parameter index -> its updated full value (levels 1-2)
        shard_out = {}  # (bucket, state slot) -> updated flat state; (param, -1): param shard
        deferred = []  # level 2: updated shards gathered once backward is done

        def reduce_scatter(bucket):
            """Start reducing a bucket's gradients, read where backward computed them (no
            packed copy: the planner keeps each alive until the wait, which names it)."""
            bucket_grads = [grads[k] for k in bucket.keys]
            out = self._alloc(f"grad_shard{bucket.index}", bucket.shard_total, bucket.dtype)
            handle = self.start("reduce_scatter", f"reduce_scatter{bucket.index}",
                                bucket_grads, [out])
            in_flight[bucket.index] = (bucket, handle, bucket_grads, out)

        pending = []  # guarded: (bucket, reduced shard) until every rank's verdict is known
        verdict = {}

        def finish_reduce(index):
            bucket, handle, bucket_grads, out = in_flight.pop(index)
            self.wait(f"wait_reduce_scatter{index}", handle, *bucket_grads, out)
            if self.guard:
                pending.append((bucket, out))
            else:
                update(bucket, out)  # the reduced shard dies right here

        def finish_all_but(keep):
            for index in list(in_flight)[:max(0, len(in_flight) - keep)]:
                finish_reduce(index)

        def finish_gathers(keep):
            while len(gathering) > keep:
                bucket, handle, new_param = gathering.pop(0)
                targets = [params[k] for k in bucket.keys]
                self.wait(f"wait_allgather_updated{bucket.index}", handle, new_param, *targets)
                full.update(zip(bucket.keys, targets))  # updated in place

        def update(bucket, grad_shard):
            """The optimizer on one bucket's flat shards: parameter k0's update chain (the
            bucket's first parameter) re-emitted on [S] buffers. Every parameter's chain is
            the same computation (_update_chains checks), so one elementwise pass updates
            the whole bucket."""
            b, keys = bucket.index, bucket.keys
            if level == 3:
                param_flat = self.concat_shards(f"param_shards{b}", [new_params[k] for k in keys])
            else:  # this rank's shard of the full parameters, cut at run time
                param_flat = self.bind(f"param_shard{b}", relax.call_dps_packed(
                    "raf_dist.ccl.local_shard", [params[k] for k in keys] + [self.group],
                    relax.TensorType([bucket.shard_total], bucket.dtype)))
            k0 = keys[0]
            mapping = {params[k0]: param_flat, marker_var[k0]: grad_shard}
            for j in range(per_param):
                mapping[states[k0 * per_param + j]] = flat_states[(b, j)]
            for binding in chains[k0]:
                value = self.seg.builder.normalize(_substitute(binding.value, mapping))
                var = relax.DataflowVar(f"{binding.var.name}_b{b}", value.ty)
                self.seg.add(relax.VarBinding(var, value))
                mapping[binding.var] = var
            new_param = mapping.get(self.result.fields[1 + k0], param_flat)
            if self.guard:
                new_param = self.bind(f"kept_param{b}", relax.op.where(
                    verdict["finite"], new_param, param_flat))
            for j in range(per_param):
                field = self.result.fields[1 + len(params) + k0 * per_param + j]
                shard_out[(b, j)] = mapping.get(field, flat_states[(b, j)])
                if self.guard:
                    shard_out[(b, j)] = self.bind(f"kept_state{b}_{j}", relax.op.where(
                        verdict["finite"], shard_out[(b, j)], flat_states[(b, j)]))
            if level == 3:
                # the split stays outside the dataflow block, so FuseOps keeps it out of the
                # update's kernel: alone it reads only the updated [S] shards, and each piece
                # can be written into its parameter's buffer (compiler.UpdateInPlace); fused,
                # every piece's block read every parameter of the bucket
                pieces = self.split_shards(f"new_param{b}", bucket, new_param, dataflow=False)
                for k, piece in zip(keys, pieces):
                    shard_out[(k, -1)] = piece
            elif level == 2:  # backward may still read the parameters: gather after it
                deferred.append((bucket, new_param))
            else:
                gather_updated(bucket, new_param)

        def gather_updated(bucket, new_param):
            """Allgather a bucket's updated shards straight into its parameters' buffers (no
            gathered copy of the bucket, no unpacking): level 1 while the next bucket is
            updated, level 2 after backward, one gather in flight behind the next."""
            targets = [params[k] for k in bucket.keys]
            gathering.append((bucket, self.start("allgather", f"allgather_updated{bucket.index}",
                                                 [new_param], targets), new_param))
            finish_gathers(1 if self.overlap else 0)

        # ---- level 3 parameter gathers
        gathers = {}
        if level == 3:
            gathers["forward"] = self._plan_gathers("forward", 0, self.forward_end + 1, new_params)
            gathers["backward"] = self._plan_gathers("backward", self.forward_end + 1,
                                                     self.optimizer_begin, new_params)
            self._prefetch(gathers["forward"], 0)
        for binding in shared:  # scalar-only work of the optimizer (e.g. on hyper-parameters)
            self.seg.add(binding)

        # ---- forward and backward; levels 2-3 reduce each bucket as soon as it is complete
        for pos in range(self.optimizer_begin):
            binding = self.bindings[pos]
            if level == 3 and pos == self.forward_end + 1:
                self._prefetch(gathers["backward"], 0)
            if pos in marker_by_pos:
                if pos in closes and level >= 2:
                    # the previous bucket's reduce_scatter has had a whole bucket of backward
                    # to finish: wait for it (and update its shards) before packing this
                    # bucket, so one packed bucket at a time is alive
                    finish_all_but(0)
                    reduce_scatter(closes[pos])
                continue
            value = binding.value
            if level == 3:
                region = gathers["forward" if pos <= self.forward_end else "backward"]
                used = [v for v in relax.analysis.free_vars(value) if v in region["index"]]
                if used:
                    value = _substitute(value, {v: self._gathered(region, v) for v in used})
            self.seg.add(relax.VarBinding(binding.var, value))
        if level == 1:  # after backward: every bucket, one after the other
            for bucket in grad_buckets:
                reduce_scatter(bucket)
                finish_all_but(1 if self.overlap else 0)
        finish_all_but(0)
        if self.guard:  # every rank's verdict first, then the (kept or skipped) updates
            verdict["finite"] = self._agreed_finite([out for _, out in pending])
            for bucket, out in pending:
                update(bucket, out)
        for bucket, new_param in deferred:
            gather_updated(bucket, new_param)
        finish_gathers(0)

        # ---- outputs: (loss, params, states)
        fields = [self.loss]
        if level == 3:
            fields += [shard_out[(k, -1)] for k in range(len(params))]
        else:
            fields += [full[k] for k in range(len(params))]
        fields += [shard_out[(b.index, j)] for b in grad_buckets for j in range(per_param)]
        fields += self.buffer_outputs
        self.bind("allreduce_loss", collective("raf_dist.ccl.allreduce", self.loss,
                                               tvm.ir.StringImm("avg"), self.group, self.loss),
                  dataflow=False)
        output = self.bind("step_outputs", relax.Tuple(fields), dataflow=False)
        func_params = list(self.func.params)
        offset = int(self.func.attrs[LAYOUT_PARAM_OFFSET])
        func_params[offset:offset + len(params)] = new_params
        func_params[offset + len(params):offset + len(params) + len(states)] = [
            flat_states[(b.index, j)] for b in grad_buckets for j in range(per_param)]
        func = assemble(self.func, self.seg.segments, output, params=func_params,
                        ret_ty=output.ty)
        # outputs 1.. still replace the parameter and state arguments, in their new layout
        n_core = len(fields) - 1 - len(self.buffer_outputs)
        # the buffers stay the last arguments; the state arguments before them changed count
        shift = len(func_params) - len(self.func.params)
        return func.with_attr(UPDATED_ARGUMENTS, list(range(offset, offset + n_core))
                              + [i + shift for i in self.buffer_arguments])

    def _agreed_finite(self, shards):
        """A 0-d bool, the same on every rank: every rank's gradient shards and loss are
        finite (NaN and inf survive a sum). The loss becomes NaN when not."""
        op = relax.op
        flag = self.bind("loss_finite", op.isfinite(self.loss))
        for i, shard in enumerate(shards):  # (bind takes one op at a time)
            total = self.bind(f"shard_sum{i}", op.sum(shard))
            finite = self.bind(f"shard_finite{i}", op.isfinite(total))
            flag = self.bind(f"finite{i}", op.logical_and(flag, finite))
        dtype = str(self.loss.ty.dtype)
        bad = self.bind("not_finite", op.where(flag, relax.const(0.0, dtype),
                                               relax.const(1.0, dtype)))
        bad = self.bind("not_finite_1", op.reshape(bad, [1]))
        total = self._alloc("not_finite_total", 1, dtype)  # a result no pass can fold away
        self.seg.bind("allreduce_not_finite", collective(
            "raf_dist.ccl.allreduce", bad, tvm.ir.StringImm("sum"), self.group, total),
            dataflow=False)
        agreed = self.bind("all_finite", op.less(self.bind("not_finite_all", op.reshape(
            total, [])), relax.const(0.5, dtype)))
        self.loss = self.bind("guarded_loss", op.where(
            agreed, self.loss, relax.const(float("nan"), dtype)))
        return agreed

    # ---- the optimizer's update chains ------------------------------------------------------
    def _update_chains(self, marker_var):
        """Split the optimizer region into one chain of bindings per parameter (what its new
        value and states are computed from) plus scalar-only bindings, and check that every
        chain is the same computation as parameter 0's up to its own tensors."""
        per_param = self.per_param
        owner = {}
        for k, p in enumerate(self.params):
            owner[p] = (k, "param")
            owner[marker_var[k]] = (k, "grad")
            for j in range(per_param):
                owner[self.states[k * per_param + j]] = (k, f"state{j}")
        chains = {k: [] for k in range(len(self.params))}
        shared = []
        for pos in range(self.optimizer_begin, len(self.bindings)):
            binding = self.bindings[pos]
            if binding.var.same_as(self.output_var):
                continue
            ks = {owner[v][0] for v in relax.analysis.free_vars(binding.value) if v in owner}
            if len(ks) > 1:
                raise ValueError(f"ShardZeRO: the optimizer update {binding.var.name} mixes "
                                 "several parameters; ZeRO needs a per-parameter elementwise update")
            if not ks:
                shared.append(binding)
                continue
            k = ks.pop()
            owner[binding.var] = (k, len(chains[k]))
            chains[k].append(binding)
        scalars = {p for p in self.func.params} | {b.var for b in shared}

        def describe(k):
            """Parameter k's chain with its variables named by role, comparable across k."""
            local = {}

            def name_of(v):
                if v in local:
                    return ("local", local[v])
                if v in owner and owner[v][0] == k:
                    return ("own", owner[v][1])
                return ("scalar", v) if v in scalars else ("foreign", v.name)

            out = []
            for i, binding in enumerate(chains[k]):
                out.append(_describe(binding.value, name_of))
                local[binding.var] = i
            results = [self.result.fields[1 + k]] + [
                self.result.fields[1 + len(self.params) + k * per_param + j]
                for j in range(per_param)]
            return out, [name_of(v) for v in results]

        reference = describe(0) if self.params else None
        for k in range(1, len(self.params)):
            if describe(k) != reference:
                raise ValueError(
                    f"ShardZeRO: parameter {self.params[k].name}'s update differs from "
                    f"{self.params[0].name}'s; ZeRO updates a bucket of parameters with one "
                    "elementwise computation, so every parameter needs the same update rule")
        return chains, shared

    # ---- level 3 gathers ------------------------------------------------------------------
    def _plan_gathers(self, region, begin, end, shard_params):
        """Buckets of the parameters read in bindings [begin, end), in first-use order."""
        param_pos = {p: k for k, p in enumerate(self.params)}
        order = []
        for pos in range(begin, end):
            for v in relax.analysis.free_vars(self.bindings[pos].value):
                if v in param_pos and param_pos[v] not in order:
                    order.append(param_pos[v])
        types = [self.params[k].ty for k in order]
        buckets = [_Bucket(b, [order[i] for i in idx], [types[i] for i in idx], self.n)
                   for b, idx in enumerate(assign_buckets([_nbytes(t) for t in types],
                                                          self.bucket_bytes))]
        return {"name": region, "buckets": buckets, "shards": shard_params,
                "index": {self.params[k]: b for b in buckets for k in b.keys},
                "param_pos": param_pos, "started": {}, "full": {}}

    def _start_gather(self, region, b):
        bucket = region["buckets"][b]
        name = f"{region['name']}_gather{b}"
        packed = self.concat_shards(f"{name}_shards", [region["shards"][k] for k in bucket.keys])
        # every parameter gathered straight into a full buffer of its own shape, which the
        # forward (backward) then reads: no [N*S] gathered bucket to unpack by copies
        outs = [self.bind(f"{name}_full{k}", relax.op.builtin.alloc_tensor(
            relax.ShapeExpr([int(d) for d in ty.shape]), bucket.dtype, relax.prim_value(0)))
            for k, ty in zip(bucket.keys, bucket.types)]
        region["started"][b] = (self.start("allgather", name, [packed], outs), packed, outs)

    def _prefetch(self, region, b):
        """With overlap, start bucket b's gather ahead of its first use."""
        if self.overlap and b < len(region["buckets"]) and b not in region["started"]:
            self._start_gather(region, b)

    def _gathered(self, region, param):
        """The full value of ``param`` in this region: gathered (with its bucket) on first use."""
        bucket = region["index"][param]
        if bucket.index not in region["full"]:
            if bucket.index not in region["started"]:
                self._start_gather(region, bucket.index)
            handle, packed, outs = region["started"][bucket.index]
            self.wait(f"wait_{region['name']}_gather{bucket.index}", handle, packed, *outs)
            self._prefetch(region, bucket.index + 1)  # the next bucket, one ahead
            region["full"][bucket.index] = dict(zip(bucket.keys, outs))
        return region["full"][bucket.index][region["param_pos"][param]]


def _describe(value, name_of):
    """A hashable description of an elementwise binding, variables named by ``name_of``."""
    if isinstance(value, relax.Var):
        return ("alias", name_of(value))
    args = []
    for arg in value.args:
        if isinstance(arg, relax.Var):
            args.append(name_of(arg))
        elif isinstance(arg, tvm.ir.expr.Constant):
            args.append(("const", str(arg.ty), arg.value.numpy().tobytes()))
        else:
            args.append(("expr", tvm.ir.structural_hash(arg)))
    return (value.op.name, tvm.ir.structural_hash(value.attrs) if value.attrs is not None else 0,
            tuple(args))


def _substitute(expr, mapping):
    return SubstituteVars(mapping).visit_expr(expr)


@tvm.transform.module_pass(opt_level=0, name="ShardZeRO")
class ShardZeRO:
    """See the module docstring."""

    def __init__(self, level, world_size, bucket_bytes, overlap=True, group=0,
                 func_name="train_step", guard=False):
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

    def transform_module(self, mod, ctx):
        func = _Rewriter(mod[self.func_name], self.level, self.world_size, self.bucket_bytes,
                         self.overlap, self.group, self.guard).run()
        # parameters (level 3) and optimizer states are now held as ShardZeRO lays them out
        func = func.with_attr("raf_dist.zero_level", self.level)
        mod = mod.__class__(dict(mod.functions_items()))
        mod[self.func_name] = func
        return relax.transform.Normalize()(mod)

"""ShardZeRO beside local parameters: the update of embedding tables sharded over the same dp
ranks (``raf_dist.local_params``), which ZeRO leaves whole (passes/zero.py).

A local parameter has no gradient marker and is no bucket's: its gradient is this rank's own
(its rows of the tables), and its update chain (dense, or an in-place row update:
``EMBEDDING_ROW_UPDATES``) is emitted as build_train_step wrote it, after the buckets'
updates. What ZeRO's agreement and options need of it:
- the guard (nonfinite="skip", fp16's loss scaling): the gradients it reads join the rank's
  verdict (``gradients``), and the update happens only when every rank's verdict is finite:
  a row update's ``keep`` flag (a constant True in a step built without a guard under ZeRO;
  ``EMBEDDING_ROW_KEEP`` says where) becomes the verdict, a dense chain's new parameter and
  states become ``where(all_finite, new, old)`` (still in place);
- clipping: this rank's sums of squares of them (``squares``; disjoint rows across the ranks,
  so the agreement's sum counts each once) and the chain run on the clipped inputs.
"""
from typing import Any, Dict, List, Optional, Tuple

from tvm import relax

from ..ir.ops import EMBEDDING_ROW_KEEP, EMBEDDING_ROW_UPDATES, EMBEDDING_ROWS_SQUARES
from ..ir.utils import is_packed_marker
from . import clipping
from .gradient_markers import substitute


class LocalChains:
    """The local parameters' part of one ShardZeRO emission (module docstring); binds
    through the emitter it belongs to."""

    def __init__(self, emitter: Any) -> None:  # zero._Emitter (which imports this module)
        self.em = emitter
        self.plan, self.step = emitter.plan, emitter.step
        # guarded dense updates: (parameter, None or state slot) -> the kept value
        self.kept: Dict[Tuple[int, Optional[int]], relax.Var] = {}
        # what each chain reads, found once (the verdict, the squares and the clipped chain
        # all ask)
        self._sparse: Dict[int, Optional[Tuple[relax.Var, relax.Var]]] = {}
        self._dense: Dict[int, Tuple[List[relax.Binding], List[relax.Var]]] = {}

    def gradients(self) -> List[relax.Var]:
        """What the local updates read of backward: a sparse update's rows' gradients, a
        dense one's gradient."""
        grads: List[relax.Var] = []
        for k in self.step.local:
            sparse = self._sparse_rows(k)
            grads.extend([sparse[1]] if sparse is not None else self._dense_reads(k)[1])
        return grads

    def squares(self) -> List[relax.Expr]:
        """This rank's sums of squares of its local parameters' gradients; a sparse update's
        by ``raf_dist.embedding.rows_squares`` (duplicate ids summed first, as the dense
        gradient would hold them)."""
        em, sums = self.em, []
        for k in self.step.local:
            sparse = self._sparse_rows(k)
            if sparse is not None:
                sums.append(em.bind(f"local_squares{k}", relax.call_pure_packed(
                    EMBEDDING_ROWS_SQUARES, *sparse, ty_args=relax.TensorType((), "float32"))))
            else:
                sums.append(clipping.squares_by_kind(em.seg.builder, self._dense_reads(k)[1],
                                                     emit=em.binder(f"local_sq{k}"))[0])
        return sums

    def emit(self, coef: Optional[relax.Var]) -> None:
        """Every local chain as it was written (clipped by ``coef``: what it reads scaled;
        guarded: kept only when every rank's verdict is finite)."""
        em = self.em
        for k in self.step.local:
            mapping = self._clipped(k, coef) if coef is not None else {}
            for binding in self.plan.update.chains[k]:
                value = substitute(binding.value, mapping) if mapping else binding.value
                if em.guard:
                    value = self._guarded_row_update(value)
                em.seg.add(relax.VarBinding(binding.var, value))
            if em.guard and self._sparse_rows(k) is None:
                self._keep(k)

    def new_param(self, k: int) -> relax.Expr:
        return self.kept.get((k, None), self.step.new_param_field(k))

    def new_state(self, k: int, j: int) -> relax.Expr:
        return self.kept.get((k, j), self.step.new_state_field(k, j))

    def _guarded_row_update(self, value: relax.Expr) -> relax.Expr:
        """A row update whose ``keep`` argument becomes every rank's verdict; other values
        unchanged."""
        for func, at in EMBEDDING_ROW_KEEP.items():
            if is_packed_marker(value, func):
                args = list(value.args)
                args[at + 1] = self.em.all_finite  # (args[0] is the packed function)
                return relax.Call(value.op, args, value.attrs, value.ty_args)
        return value

    def _keep(self, k: int) -> None:
        """A dense update's new parameter and states, or the old ones when any rank's verdict
        is not finite (elementwise with a scalar condition: still in place)."""
        step = self.step
        pairs = [((k, None), step.new_param_field(k), step.params[k])] + [
            ((k, j), step.new_state_field(k, j), step.state(k, j))
            for j in range(step.per_param)]
        for key, new, old in pairs:
            if not new.same_as(old):
                self.kept[key] = self.em.keep_if_finite(
                    f"kept_local{k}_{'param' if key[1] is None else key[1]}", new, old)

    def _sparse_rows(self, k: int) -> Optional[Tuple[relax.Var, relax.Var]]:
        """(ids, rows' gradients) that local parameter k's in-place row update reads (a
        ``EMBEDDING_ROW_UPDATES`` call of its chain), or None for a dense update."""
        if k not in self._sparse:
            self._sparse[k] = self._find_sparse_rows(k)
        return self._sparse[k]

    def _find_sparse_rows(self, k: int) -> Optional[Tuple[relax.Var, relax.Var]]:
        for binding in self.plan.update.chains[k]:
            value = binding.value
            if not any(is_packed_marker(value, f) for f in EMBEDDING_ROW_UPDATES):
                continue
            args = [a for a in value.args[1:] if isinstance(a, relax.Var)
                    and isinstance(a.ty, relax.TensorType)]
            ids = next(i for i, a in enumerate(args) if "int" in str(a.ty.dtype))
            rows = next(a for a in args[ids + 1:] if "float" in str(a.ty.dtype))
            return args[ids], rows
        return None

    def _dense_reads(self, k: int) -> Tuple[List[relax.Binding], List[relax.Var]]:
        """(the update tail's bindings local parameter k's chain reads, in order; the values
        of backward they and the chain read: its gradient). A local parameter has no marker
        (zero_plan): its optimizer's first products of the gradient (Adam's (1 - beta) g)
        own no parameter tensor, so they sit in the tail."""
        if k not in self._dense:
            self._dense[k] = self._find_dense_reads(k)
        return self._dense[k]

    def _find_dense_reads(self, k: int) -> Tuple[List[relax.Binding], List[relax.Var]]:
        update = self.plan.update
        tail_at = {b.var: i for i, b in enumerate(update.tail)}
        outside = set(self.step.func.params) | {b.var for b in update.shared}
        defined = {b.var for b in update.chains[k]}
        used, reads, seen = set(), [], set()
        stack = [v for b in update.chains[k] for v in relax.analysis.free_vars(b.value)]
        while stack:
            v = stack.pop()
            if v in seen or v in defined or v in outside:
                continue
            seen.add(v)
            if v in tail_at:
                used.add(tail_at[v])
                stack.extend(relax.analysis.free_vars(update.tail[tail_at[v]].value))
            elif "float" in str(getattr(v.ty, "dtype", "")):
                reads.append(v)
        return [update.tail[i] for i in sorted(used)], sorted(reads, key=lambda v: v.name)

    def _clipped(self, k: int, coef: relax.Var) -> Dict[relax.Var, relax.Expr]:
        """What local parameter k's chain reads, clipped: a sparse update's rows scaled by the
        coefficient; a dense one's gradient scaled and the tail's products of it emitted again
        from the scaled gradient."""
        em = self.em
        sparse = self._sparse_rows(k)
        if sparse is not None:
            return {sparse[1]: clipping.scaled(em.seg.builder, sparse[1], coef,
                                               emit=em.binder(f"clipped_rows{k}"))}
        tail, reads = self._dense_reads(k)
        mapping: Dict[relax.Var, relax.Expr] = {
            v: clipping.scaled(em.seg.builder, v, coef, emit=em.binder(f"clipped{k}_"))
            for v in reads}
        for binding in tail:
            mapping[binding.var] = em.bind(f"{binding.var.name}_clipped{k}",
                                           substitute(binding.value, mapping))
        return mapping

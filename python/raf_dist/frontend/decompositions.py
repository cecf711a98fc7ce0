"""The decomposition to core ATen operators that ``import_program`` asks torch.export for
(``ExportedProgram.run_decompositions``), with PyTorch's own table corrected where it is wrong,
and its failures reported as PyTorch's. In-place dropout is made out-of-place first, so that it
decomposes as dropout does (``frontend/in_place.py``).

CPU scaled-dot-product attention (PyTorch 2.13). On CPU, ``F.scaled_dot_product_attention``
is exported as ``aten._scaled_dot_product_flash_attention_for_cpu``. Its meta function, against
which torch.export traced everything after it, returns ``torch.empty_like(query)``: the output
has the query's memory layout. PyTorch's decomposition of the op
(``torch/_decomp/decompositions.py``) computes the same values through
``_scaled_dot_product_attention_math`` but then hard-codes the layout (seq, batch, heads, dim),
the one ``nn.MultiheadAttention``'s query happens to have (its comment says it was written for
that caller). ``run_decompositions`` replays every later ``view`` of the exported graph on the
decomposed tensor; a view that was valid for the op's layout can be invalid for the other one.
Hugging Face's sdpa attention (GPT-2) hits it: its query is (batch, seq, heads, dim) in memory,
so ``attn_output.transpose(1, 2).contiguous()`` was already contiguous when exported and
recorded no copy, and GPT-2's Conv1D then views (batch, seq, hidden) as (batch * seq, hidden),
which merges batch and seq: with the decomposition's layout they are not adjacent in memory
and torch raises "Cannot view a tensor with shape [2, 8, 16] and strides (16, 32, 1) as
(16, 16)". (Batch 1 hides it: a dimension of size 1 never blocks a view.) It reproduces with
torch alone: export, then ``run_decompositions()``.

``_sdpa_flash_for_cpu`` keeps PyTorch's math (``_scaled_dot_product_attention_math``, which
applies the mask, scale, causal flag and grouped-query heads exactly as PyTorch does) and gives
the output the layout the meta function promised: the query's, computed with the permutation
``empty_like`` itself uses. Every view traced against the op is then valid on its
decomposition. The values are untouched (a permute, a contiguous copy, the inverse permute);
the Relax importer never sees strides.
"""
import logging

from . import in_place

_LOG = logging.getLogger("raf_dist")


class DecompositionError(ValueError):
    """torch.export's decomposition to core ATen operators failed: in PyTorch, before the Relax
    importer or raf_dist's converters saw the graph."""


def decomposition_table(math_attention: bool = False) -> dict:
    """PyTorch's default decomposition table, with the CPU attention kept whole: the importer
    converts it to raf_dist's attention op (frontend/torch_ops.py). ``math_attention``
    instead: its decomposition to PyTorch's math (the T x T scores), laid out right."""
    import torch

    table = torch.export.default_decompositions()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if math_attention:
        table[op] = _sdpa_flash_for_cpu
    else:
        table.pop(op, None)
    return table


def _sdpa_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                        scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu`` -> (output, attention weights), the
    output laid out in memory as the query (as the op's meta function: ``empty_like(query)``)."""
    import torch
    from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

    torch._check(dropout_p == 0.0,
                 lambda: f"dropout probability must be zero, got {dropout_p}")  # as PyTorch's
    output, weights = torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        dropout_mask=None, scale=scale, enable_gqa=query.size(1) != key.size(1))
    physical, _ = compute_elementwise_output_logical_to_physical_perm(query)
    logical = sorted(range(len(physical)), key=physical.__getitem__)
    output = output.permute(physical).contiguous(memory_format=torch.contiguous_format)
    return output.permute(logical), weights


def _log_math_attention(exported) -> None:
    """One log line per module whose ``F.scaled_dot_product_attention`` PyTorch will
    decompose to its math path (dropout_p > 0: its CPU flash kernel has no dropout), so it
    trains with the T x T scores instead of raf_dist's attention op (ir/attention.py)."""
    import torch

    from .torch_ops import module_path

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    where = []
    for node in exported.graph.nodes:
        if node.op == "call_function" and node.target is sdpa:
            dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0)
            if dropout_p:
                where.append(module_path(node) or "the top-level module's forward")
    if where:
        _LOG.info("attention with dropout_p > 0 (%s) stays on the T x T path: PyTorch's CPU "
                  "flash kernel, which raf_dist's attention op calls, has no dropout; set "
                  "dropout_p=0 for memory O(T)", ", ".join(sorted(set(where))))


def run_decompositions(exported, what: str):
    """``exported.run_decompositions`` with ``decomposition_table()``, after rewriting each
    in-place dropout of ``exported`` (in place) as its out-of-place form
    (``in_place.functional_dropout``); a failure raises DecompositionError naming PyTorch's
    decomposition as the failing layer. ``what``: the module being captured, for the message."""
    import torch

    in_place.functional_dropout(exported)
    _log_math_attention(exported)
    try:
        return exported.run_decompositions(decomposition_table())
    except Exception as err:
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        where = next((line.strip() for line in lines if line.strip().startswith(
            "While executing")), None)
        raise DecompositionError(
            f"capturing {what}: torch.export's decomposition to core ATen operators "
            f"(ExportedProgram.run_decompositions, PyTorch {torch.__version__}) failed, before "
            f"the Relax importer saw the graph: {lines[0] if lines else type(err).__name__}"
            + (f" ({where})" if where else "")
            + ". Reproduce it with torch alone (torch.export.export(module, inputs)"
            ".run_decompositions()); if an operator's decomposition is at fault, correct it in "
            "raf_dist/frontend/decompositions.py as is done for CPU attention") from err

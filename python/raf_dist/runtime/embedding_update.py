"""The sparse updates of an embedding table sharded over the dp ranks (training/step.py emits
them through the optimizer's ``emit_row_update`` when it ``updates_rows``): work in proportion
to the ids, not to the table (what ``nn.Embedding(sparse=True)`` does with torch.optim.SGD, and
FBGEMM's fused row-wise Adagrad); the dense gradient of the table is never formed. Each writes
its first argument in place, only when ``keep`` (the step's finite verdict) is set:

- ``raf_dist.embedding.sgd_rows(table, ids, rows, lr, keep) -> table``:
  ``table[ids] -= lr * rows``, duplicates added;
- ``raf_dist.embedding.adagrad_sum(sum, ids, rows, keep, row_wise) -> sum``: each looked-up
  row's gradient (its duplicates summed, as the dense gradient sums them) squared into its
  accumulator (row-wise: the row's mean square into its one value);
- ``raf_dist.embedding.adagrad_rows(table, sum, ids, rows, clr, eps, keep) -> table``:
  ``table[u] -= clr * g[u] / (sqrt(sum[u]) + eps)`` over the unique ids ``u``.

and, for clipping by the global norm, ``raf_dist.embedding.rows_squares(ids, rows) -> 0-d
float32``: the sum of squares of the table gradient the rows make (duplicates summed first).

Packed functions rather than TVM kernels: TVM's scatter kernels write a copy of the whole
table (O(rows)); numpy on a zero-copy view of the runtime tensor (DLPack) touches only the ids'
rows. Host tensors only (the CPU path)."""
import numpy as np
import tvm
import tvm_ffi

from ..ir.ops import (EMBEDDING_ADAGRAD_ROWS, EMBEDDING_ADAGRAD_SUM, EMBEDDING_ROWS_SQUARES,
                      EMBEDDING_SGD_ROWS)


def _host_view(tensor):
    if tensor.device.dlpack_device_type() != 1:  # kDLCPU
        raise NotImplementedError("the sparse embedding update runs on host tensors only")
    return np.from_dlpack(tensor)


def _sgd_rows(table, ids, rows, lr, keep):
    view = _host_view(table)
    if bool(keep.numpy()) and ids.shape[0]:
        np.add.at(view, ids.numpy(), rows.numpy() * -lr.numpy().astype(view.dtype))
    return table


def _summed(ids, rows, dtype):
    """(unique ids, each one's gradient: its rows summed in id order)."""
    unique, inverse = np.unique(ids.numpy(), return_inverse=True)
    grads = np.zeros((unique.shape[0],) + tuple(rows.shape[1:]), dtype=dtype)
    np.add.at(grads, inverse.reshape(-1), rows.numpy().astype(dtype, copy=False))
    return unique, grads


def _adagrad_sum(total, ids, rows, keep, row_wise):
    view = _host_view(total)
    if bool(keep.numpy()) and ids.shape[0]:
        unique, grads = _summed(ids, rows, view.dtype)
        squares = grads * grads
        if bool(row_wise.numpy()) and squares.ndim > 1:
            squares = squares.mean(axis=tuple(range(1, squares.ndim)), keepdims=True)
        view[unique] += squares
    return total


def _adagrad_rows(table, total, ids, rows, clr, eps, keep):
    view = _host_view(table)
    if bool(keep.numpy()) and ids.shape[0]:
        unique, grads = _summed(ids, rows, view.dtype)
        denom = np.sqrt(np.from_dlpack(total)[unique]) + eps.numpy().astype(view.dtype)
        view[unique] -= clr.numpy().astype(view.dtype) * (grads / denom)
    return table


def _rows_squares(ids, rows):
    _, grads = _summed(ids, rows, np.float32)
    return tvm.runtime.tensor(np.array(np.sum(grads * grads, dtype=np.float32)), tvm.cpu())


tvm_ffi.register_global_func(EMBEDDING_SGD_ROWS, _sgd_rows, override=True)
tvm_ffi.register_global_func(EMBEDDING_ROWS_SQUARES, _rows_squares, override=True)
tvm_ffi.register_global_func(EMBEDDING_ADAGRAD_SUM, _adagrad_sum, override=True)
tvm_ffi.register_global_func(EMBEDDING_ADAGRAD_ROWS, _adagrad_rows, override=True)

"""``raf_dist.embedding.sgd_rows(table, ids, rows, lr, keep) -> table``: the sparse SGD
update of an embedding table (training/step.py emits it for a table sharded over the dp
ranks when its optimizer is plain SGD): ``table[ids] -= lr * rows``, duplicates added, in
place, when ``keep`` (the step's finite verdict) is set. Work in proportion to the ids,
not to the table (what ``nn.Embedding(sparse=True)`` with ``torch.optim.SGD`` does); the
dense gradient of the table is never formed.

A packed function rather than a TVM kernel: TVM's scatter kernels write a copy of the whole
table (O(rows)); numpy's ``add.at`` on a zero-copy view of the runtime tensor (DLPack)
touches only the ids' rows. Host tensors only (the CPU path)."""
import numpy as np
import tvm_ffi

from ..ir.ops import EMBEDDING_SGD_ROWS


def _sgd_rows(table, ids, rows, lr, keep):
    if table.device.dlpack_device_type() != 1:  # kDLCPU
        raise NotImplementedError("the sparse embedding update runs on host tensors only")
    if bool(keep.numpy()) and ids.shape[0]:
        view = np.from_dlpack(table)
        np.add.at(view, ids.numpy(), rows.numpy() * -lr.numpy().astype(view.dtype))
    return table


tvm_ffi.register_global_func(EMBEDDING_SGD_ROWS, _sgd_rows, override=True)

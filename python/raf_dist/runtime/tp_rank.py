"""``raf_dist.tp_rank_tensor(like, group)``: what a lowered ``raf_dist.tp_rank`` op calls
(ir/ops.py; passes/tp_ops.py lowers it): this rank's position in the native process group
``group`` as a 0-d int64 tensor on ``like``'s device. A Python callback, a few microseconds,
once per step."""
import numpy as np
import tvm
import tvm_ffi

from .. import _native
from ..ir.ops import TP_RANK_FUNC


def _rank_tensor(like, group):
    return tvm.runtime.tensor(np.array(_native.func("group_rank")(int(group)), dtype="int64"),
                              device=like.device)


tvm_ffi.register_global_func(TP_RANK_FUNC, _rank_tensor, override=True)

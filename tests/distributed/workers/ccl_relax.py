"""Collectives called from a compiled Relax function: destination-passing (call_dps_packed),
in place (call_packed with the input as output) and asynchronous start/wait. Prints 'ALL OK'."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist import distributed as dist


@I.ir_module
class Step:
    @R.function(pure=False)
    def main(x: R.Tensor((10,), "float32")):
        # destination passing: a fresh output
        total = R.call_dps_packed("raf_dist.ccl.allreduce", (x, R.str("sum"), R.prim_value(0)),
                                  out_ty=R.Tensor((10,), "float32"))
        # in place, asynchronous: the buffer is named in wait so it stays live until then
        handle = R.call_packed("raf_dist.ccl.allreduce_start", total, R.str("avg"), R.prim_value(0),
                               total, ty_args=R.Prim("int64"))
        _ = R.call_packed("raf_dist.ccl.wait", handle, total, ty_args=R.Tuple())
        shard = R.call_dps_packed("raf_dist.ccl.reduce_scatter", (x, R.str("max"), R.prim_value(0)),
                                  out_ty=R.Tensor((5,), "float32"))
        full = R.call_dps_packed("raf_dist.ccl.allgather", (shard, R.prim_value(0)),
                                 out_ty=R.Tensor((10,), "float32"))
        return (total, full)


def main():
    comm = dist.get_communicator()
    assert comm.size == 2, "this worker's shapes assume 2 ranks"
    vm = relax.VirtualMachine(tvm.compile(Step, target="llvm"), tvm.cpu())
    x = np.arange(10, dtype=np.float32) * (comm.rank + 1)
    total, full = vm["main"](tvm.runtime.tensor(x))
    base = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(total.numpy(), base * 3)  # sum over ranks, then avg of equals
    np.testing.assert_array_equal(full.numpy(), base * 2)   # elementwise max, sharded and regathered
    print(f"rank {comm.rank}: ALL OK")


if __name__ == "__main__":
    main()

"""IR tier for ScheduleCPU: the loops it produces (kinds and extents), and unchanged results."""
import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.compiler import ScheduleCPU


def _lowered(mod):
    with tvm.target.Target("llvm"):
        return tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                         relax.transform.AnnotateTIROpPattern(),
                                         relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


def _loop_kinds(func):
    kinds = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: kinds.append(
        (loop.kind, int(loop.extent))))])
    return kinds


@I.ir_module
class Elementwise:
    @R.function
    def main(x: R.Tensor((256, 512), "float32"), y: R.Tensor((256, 512), "float32")):
        with R.dataflow():
            z = R.nn.relu(R.add(R.multiply(x, y), x))
            R.output(z)
        return z


def test_elementwise_is_fused_parallel_and_vectorised():
    scheduled = ScheduleCPU()(_lowered(Elementwise))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(prims) == 1
    kinds = _loop_kinds(prims[0])
    # one fused loop split into 256*512/8 parallel iterations of 8 vector lanes
    assert sorted(kinds, key=lambda k: k[1]) == [(tirx.ForKind.VECTORIZED, 8),
                                                 (tirx.ForKind.PARALLEL, 256 * 512 // 8)]


def test_small_work_stays_serial():
    @I.ir_module
    class Small:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                z = R.exp(x)
                R.output(z)
            return z

    prims = [f for _, f in ScheduleCPU()(_lowered(Small)).functions_items()
             if isinstance(f, tirx.PrimFunc)]
    assert all(kind != tirx.ForKind.PARALLEL for kind, _ in _loop_kinds(prims[0]))


def test_reduction_parallel_over_rows_and_same_result():
    @I.ir_module
    class RowSum:
        @R.function
        def main(x: R.Tensor((512, 64), "float32")):
            with R.dataflow():
                z = R.sum(R.exp(x), axis=[1])
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(RowSum))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert any(kind == tirx.ForKind.PARALLEL and extent == 512
               for f in prims for kind, extent in _loop_kinds(f))
    x = np.random.default_rng(0).standard_normal((512, 64)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), np.exp(x).sum(1),
                               rtol=1e-5)


def test_column_reduction_walks_rows_inside_column_bands():
    @I.ir_module
    class ColumnSum:
        @R.function
        def main(x: R.Tensor((1024, 512), "float32")):
            with R.dataflow():
                z = R.collapse_sum_to(x, R.shape([512]))  # a bias gradient
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(ColumnSum))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    kinds = _loop_kinds(prims[0])
    # 64 parallel bands of 8 columns; inside, rows in order (1024), then 8 contiguous columns
    assert (tirx.ForKind.PARALLEL, 64) in kinds
    assert (tirx.ForKind.SERIAL, 1024) in kinds
    x = np.random.default_rng(1).standard_normal((1024, 512)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), x.sum(0), rtol=1e-4,
                               atol=1e-4)

"""runtime/host_kernels.py: the step's host-kernel calls listed from a planned step, and run
once on operands that leave nothing behind (what tools/estimate_memory measures with them)."""
import torch

from raf_dist import process_memory
from raf_dist.compiler.build import planned_module
from raf_dist.compiler.step_passes import step_passes
from raf_dist.frontend import from_pytorch
from raf_dist.optim import SGD
from raf_dist.runtime import host_kernels
from raf_dist.training import build_train_step


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


def test_host_calls_of_a_conv_step():
    torch.manual_seed(0)
    model = from_pytorch(_ConvNet(), (torch.randn(4, 3, 8, 8),))
    mod, _ = build_train_step(model, "cross_entropy", SGD(0.1))
    calls = host_kernels.host_calls(planned_module(mod, step_passes(0, 1, 2**20)))
    by_kind = {}
    for call in calls:
        by_kind.setdefault(call.symbol.rsplit(".", 1)[1], []).append(call)
    # forward: two convolutions and the classifier's GEMM; backward: both weight gradients
    # (conv2d in the CNHW/IOHW form), conv2's data gradient (conv1's input needs none) and
    # the classifier's two gradient GEMMs
    assert len(by_kind["conv2d"]) == 4 and len(by_kind["conv2d_transpose"]) == 1
    assert len(by_kind["matmul"]) == 3
    first = next(c for c in by_kind["conv2d"] if c.args[5] == "NCHW,OIHW,NCHW"
                 and c.args[0][1] == (4, 3, 8, 8))
    assert first.args[1] == ("tensor", (8, 3, 3, 3), "float32")  # the weight
    assert first.args[2:5] == ((1, 1), (1, 1, 1, 1), (1, 1))  # strides, padding, dilation
    assert first.args[6] == ("tensor", (4, 8, 8, 8), "float32")  # the output it writes
    assert len(set(calls)) == len(calls)  # each distinct call once
    # every call runs on zero operands of its shapes
    host_kernels.run_once(calls)


def test_operands_are_given_back_whole():
    """A GEMM over 3 x 16 MiB of operands (its output written: 16 MiB of private pages
    while it runs): after it, the process holds none of them (they lived in mappings of their
    own), only what the BLAS keeps for itself once warm (nothing more here)."""
    n = 2048  # 16 MiB per float32 operand
    call = host_kernels.HostCall("raf_dist.blas.matmul", (
        ("tensor", (n, n), "float32"), ("tensor", (n, n), "float32"), 0, 0,
        ("tensor", (n, n), "float32")))
    assert call.tensor_bytes() == 3 * n * n * 4
    host_kernels.run_once([call])  # the BLAS's own first-call set-up
    before = process_memory._status_kib("RssAnon") * 1024
    host_kernels.run_once([call])
    grown = process_memory._status_kib("RssAnon") * 1024 - before
    assert grown < 4 * 2**20, grown  # not the 16 MiB of output the GEMM wrote


def test_measured_in_a_child_that_the_caller_does_not_keep():
    """``measure`` runs the calls in a child process (the threads a rank would have are made
    there): what the BLAS keeps is seen (its packing buffers: MiB, not 0), nothing of it
    stays here, and a child that fails leaves the terms at 0 with a warning, not an error."""
    n = 1024
    call = host_kernels.HostCall("raf_dist.blas.matmul", (
        ("tensor", (n, n), "float32"), ("tensor", (n, n), "float32"), 0, 0,
        ("tensor", (n, n), "float32")))
    before = process_memory._status_kib("RssAnon") * 1024
    got = host_kernels.measure([call], threads=2)
    assert got["runtime_bytes"] > 2**20, got
    assert process_memory._status_kib("RssAnon") * 1024 - before < 2**20
    assert host_kernels.measure([], threads=2) == {"runtime_bytes": 0, "allocator_free_bytes": 0}
    broken = host_kernels.HostCall("raf_dist.blas.no_such_kernel", (1,))
    assert host_kernels.measure([broken], threads=1) == {"runtime_bytes": 0,
                                                          "allocator_free_bytes": 0}


def test_16_bit_operands_are_retyped_views():
    """numpy has no 16-bit float DLPack type: the operand is an integer view retyped in TVM,
    and the 16-bit GEMM takes it."""
    with host_kernels._zero_tensor((64, 32), "bfloat16") as tensor:
        assert str(tensor.dtype) == "bfloat16" and tuple(tensor.shape) == (64, 32)
        del tensor
    host_kernels.run_once([host_kernels.HostCall("raf_dist.blas.matmul", (
        ("tensor", (64, 32), "bfloat16"), ("tensor", (32, 16), "bfloat16"), 0, 0,
        ("tensor", (64, 16), "bfloat16")))])

"""Where a GPU training step's time goes, callee by callee.

    python bench/gpu_kernels.py [--model gpt|mlp|gemm_gpt] [--steps 10] [--top 25]
                                [--device cuda|cpu]

Trains the model on ``cuda`` (AdamW), times ``--steps`` plain steps (``Trainer.step`` returns
the loss as a float, so each step ends synchronised), then runs ``--steps`` more with a VM
instrument that synchronises the device before and after every call the step's VMs make, and
prints per callee (a generated kernel, ``raf_dist.blas.*``, a VM builtin) its calls and
milliseconds a step. A synchronised call's time is its own (launch and kernel), not the
queue's: the sum over callees exceeds the plain step by the launches that overlap in the
plain step. ``Trainer.profile`` cannot say this on a GPU: without the synchronisation its
events are launch times. ``--device cpu`` runs the same on the host (no synchronisation to
do there; Trainer.profile says as much).
"""
import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def make(name):
    if name == "gemm_gpt":
        import mixed_precision
        return mixed_precision.make(name)
    import step_time
    return step_time.make(name)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt", choices=["gpt", "mlp", "gemm_gpt"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()
    import tvm

    import raf_dist

    dev = tvm.cuda(0) if a.device == "cuda" else tvm.cpu(0)
    if not dev.exist:
        raise SystemExit("bench/gpu_kernels.py needs a CUDA GPU (tvm.cuda(0) does not exist)")
    module, x, y = make(a.model)
    start = time.perf_counter()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), device=a.device,
                               cache_dir=tempfile.mkdtemp(prefix="raf_dist_gk_"))
    compile_s = time.perf_counter() - start
    xn, yn = x.numpy(), y.numpy()
    plain_ms = harness.median_ms(lambda: trainer.step(xn, yn), a.steps, warmup=3)

    totals, calls, opened = defaultdict(float), defaultdict(int), []

    def instrument(func, symbol, before_run, ret_value, *args):
        dev.sync()
        now = time.perf_counter()
        if before_run:
            opened.append(now)
        else:
            totals[str(symbol)] += now - opened.pop()
            calls[str(symbol)] += 1
        return 0  # run the call as usual

    vms = trainer.executor._vms
    for vm in vms:
        vm.set_instrument(instrument)
    synced = []
    for _ in range(a.steps):
        t = time.perf_counter()
        trainer.step(xn, yn)
        synced.append((time.perf_counter() - t) * 1e3)
    for vm in vms:
        vm.set_instrument(None)
    n = a.steps
    total_ms = sum(totals.values()) * 1e3 / n
    print(f"# {a.model} on {dev.device_name}; raf_dist from {Path(raf_dist.__file__).parent}; "
          f"compile {compile_s:.1f} s")
    print(f"# plain step {plain_ms:.2f} ms (median of {n}); synchronised step "
          f"{statistics.median(synced):.2f} ms, its calls {total_ms:.2f} ms in {sum(calls.values()) // n} "
          f"calls a step")
    print(f"{'callee':<48} {'calls':>6} {'ms/step':>9} {'share':>7}")
    for symbol, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:a.top]:
        ms = seconds * 1e3 / n
        print(f"{symbol[:48]:<48} {calls[symbol] / n:>6.0f} {ms:>9.3f} {ms / total_ms:>7.1%}")


if __name__ == "__main__":
    main()

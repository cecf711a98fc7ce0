"""Trainer.stats()'s memory accounting against the process's real resident set.

Each model trains 3 steps in a process of its own (tests/numeric/memory_probe.py: capture,
Trainer, steps); the RSS growth from just before the capture to after the steps is compared
with ``stats()["total_bytes"]`` (parameters, optimizer state, planned step temporaries,
compiled code, and the libraries loading them added: TVM, torch.export, MPI;
raf_dist/process_memory.py).

Measured on this 2-core machine (growth / total, 2026-11-26, before the Trainer dropped the
compiler's resident pages after construction: both sides fell by those pages since): wide_mlp
1.06-1.10, gpt2 (transformers) 1.07-1.11, resnet (torchvision) 1.13-1.24, the high ends with the step compiled in the process
(a cold build cache, as this test session's). 2026-11-28, the step built in a forked process
(cold and warm alike): wide_mlp 1.13, gpt2 1.13, resnet 1.29 (bench/RESULTS.md says where the
rest is, phase by phase). Libraries count their anonymous memory at load
plus their shared objects' resident pages read when stats() is called (code pages become
resident as they first run). What is not accounted for, ~40-90 MiB whatever the model: the
compiler's freed heap that glibc cannot return (fragmented by live IR objects), the IR and VM
objects themselves, the first step's allocator arenas. The bound below (1.4) is therefore a
check that no large term is missing — before this accounting (no library term, a second copy
of the weights held by the Model and the torch module kept alive by the capture) the same
runs gave 1.7-2.0 — not a 10% agreement, which two of the three meet.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raf_dist import process_memory

PROBE = Path(__file__).resolve().parent / "memory_probe.py"


def _probe(name):
    out = subprocess.run([sys.executable, str(PROBE), name], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["wide_mlp", "gpt2", "resnet"])
def test_stats_total_predicts_rss_growth(name):
    got = _probe(name)
    growth, total = got["growth"], got["total_bytes"]
    assert set(got["libraries"]) >= {process_memory.COMPILER, "torch.export"}
    # the parts add up, and the total is what the process grew by, within the bound above
    parts = ("param_bytes", "optimizer_state_bytes", "planned_peak_bytes",
             "compiled_code_bytes", "library_bytes")
    assert total == sum(got[k] for k in parts)
    assert got["compiled_code_bytes"] > 0 and got["library_bytes"] > 100 * 2**20
    assert 0.9 * total <= growth <= 1.4 * total, (name, growth / total, got)
    # after construction the compiler's code is not resident (process_memory
    # release_compiler_pages: 80-90 MiB of libtvm_compiler.so otherwise), and the steps
    # after it did not fault most of it back. What stays: its relocated (private) pages,
    # ~3 MiB, and what runs after construction: 4 MiB resident with a warm build cache,
    # 14-15 MiB with a cold one (a fresh clone's), measured here
    assert got["compiler_files"], "libtvm_compiler.so is not mapped: the check saw nothing"
    assert got["compiler_resident"] < 32 * 2**20, got["compiler_resident"]
    # construction's peak (capture and Trainer, the step compiled in the process when the
    # build cache is cold, as in a fresh clone) within 10% of the steady state after the
    # steps (#31): the step is compiled in a forked build process (compiler/build.py), whose
    # heap and compiler code leave with it. Measured here, cold and warm alike: wide_mlp
    # 0.99, gpt2 0.69, resnet 0.94; compiled in the process, cold, resnet was 1.18 (the
    # compile's ~170 MiB transient over a 650 MiB process) and the 23M GPT 1.09-1.14
    assert got["construction_peak"] <= 1.1 * got["steady_rss"], (
        name, got["construction_peak"] / got["steady_rss"])


def test_capture_keeps_no_reference_to_the_module():
    """from_pytorch's Model holds its own copy of the values and nothing of the module:
    dropping the module frees it; capturing again at another batch size still works (a
    weightless twin) and shares the Model's values."""
    import gc
    import weakref

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import make

    from raf_dist.frontend import from_pytorch

    module, x, _ = make("transformer", 4)
    alive = weakref.ref(module)
    params = [weakref.ref(p) for p in module.parameters()]
    model = from_pytorch(module, (x,))
    del module
    gc.collect()
    assert alive() is None and all(p() is None for p in params)
    other = model.at_batch(3)
    assert other.input_specs[0][0][0] == 3 and other.init_params is model.init_params


def test_trainer_keeps_one_copy_of_the_weights():
    """After construction the Trainer's tensors are the only copy: the Model's initial
    values are let go (the executor keeps shapes only) and a new batch size still trains."""
    import gc
    import weakref

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import make

    import raf_dist

    module, x, y = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    values = [weakref.ref(v) for v in model.init_params.values()]
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))
    del model
    gc.collect()
    assert all(v() is None for v in values)
    held = trainer.executor.model.init_params
    assert all(np.asarray(v).base is not None and np.asarray(v).strides == (0,) * v.ndim
               for v in held.values() if v.ndim)
    first = trainer.state_dict()
    assert np.isfinite(trainer.step(x.numpy()[:5], y.numpy()[:5]))  # captured again at 5 rows
    assert any(not np.array_equal(first[n], v) for n, v in trainer.state_dict().items())

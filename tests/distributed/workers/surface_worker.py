"""The whole public surface of ``raf_dist.Trainer`` on one layout of 2 ranks: every public
method and property (read from the class, so one added later is walked too) is called and
checked, or must raise a clear NotImplementedError naming itself.

Usage: surface_worker.py LAYOUT DIR
  plain  no parallelism: each rank trains on its own (after agreeing on that)
  dp     data parallel over 2 ranks (ZeRO-1)
  tp     tensor parallel over 2 ranks
  pp     2 pipeline stages, 2 microbatches (1F1B)
Steps run at three global batch sizes (8, then 6, then 5 rows: uneven over dp and over the
microbatches); losses and parameters must equal one process that takes the same batches.
Prints 'rank R: SURFACE OK <layout>'."""
import inspect
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err  # noqa: E402

SIZES = (8, 6, 5)  # global rows of each step
TOL = 5e-5  # float reduction order of the splits (as pp_train.py / tp_train.py)
LAYOUTS = {
    "plain": {},
    "dp": {"enable_data_parallel": True, "zero_opt_level": 1},
    "tp": {"tensor_parallel_size": 2},
    "pp": {"pipeline_parallel_size": 2, "num_microbatches": 2},
}


def reference(x, y):
    """One process on every step's global batch (rank 0 alone, then broadcast)."""
    comm = dist.get_communicator()
    result = None
    if comm.rank == 0:
        module, _, _ = make("mlp", 8, seed=0)
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_optimizer("adamw"), local=True)
        result = ([trainer.step(x[:n].numpy(), y[:n].numpy()) for n in SIZES],
                  trainer.state_dict())
    comm.idle_barrier()
    return comm.mpi_comm.bcast(result, root=0)


def main():
    layout, directory = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    comm = dist.get_communicator()
    config = dist.get_config()
    ref_losses, ref_params = reference(*make("mlp", 8, seed=0)[1:])
    config.update(LAYOUTS[layout])
    module, x, y = make("mlp", 8, seed=0)
    mesh = dist.get_mesh() if layout != "plain" else None  # plain: no mesh of 2 ranks
    dp, dp_rank = (mesh.dp_size, mesh.dp_rank) if mesh else (1, 0)

    def mine(n):  # this rank's slice of a global batch of n rows (np.array_split's rule)
        rows = np.array_split(np.arange(n), dp)[dp_rank]
        return x[rows].numpy(), y[rows].numpy()

    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (torch.from_numpy(
        mine(8)[0]),)), optimizer=raf_optimizer("adamw"))
    assert isinstance(trainer, raf_dist.Trainer)
    public = {n for n, _ in inspect.getmembers(type(trainer)) if not n.startswith("_")}
    walked = set()

    def walk(name):
        walked.add(name)
        return getattr(trainer, name)

    # profile the first step: a trace with the VM's calls (and the pipeline's F / B)
    trace = Path(walk("profile")(1, directory / layout))
    losses = [walk("step")(*mine(n)) for n in SIZES]
    assert walk("step_count") == len(SIZES)
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert "step" in cats and len(events) > 3, cats
    assert layout != "pp" or "pipeline" in cats, cats
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    params = walk("state_dict")()
    assert list(params) == [n for n, _ in module.named_parameters()], list(params)
    for name, value in ref_params.items():
        assert params[name].shape == value.shape, name
        assert rel_err(params[name], value) <= TOL, (name, rel_err(params[name], value))
    states = walk("optimizer_state_dict")()
    assert set(states) == set(params) and all(
        set(s) == {"exp_avg", "exp_avg_sq"} for s in states.values()), states.keys()
    assert walk("buffers_dict")() == dict(module.named_buffers())
    sizes = walk("compiled_batch_sizes")
    local_rows = {len(mine(n)[0]) for n in SIZES}
    assert set(sizes) >= (local_rows if layout != "pp" else {8, 6}), sizes
    assert walk("dropout_masks")(1) == []
    digest, description = walk("fingerprint")()
    assert isinstance(digest, str) and "config" in description
    assert isinstance(walk("num_grad_buckets"), int)
    assert isinstance(walk("update_guarded"), bool)
    assert walk("last_lr") == raf_optimizer("adamw").lr  # no schedule: the constructor's
    assert walk("loss_scale") is None  # fp32: no loss scaling
    assert walk("last_grad_norm") is None  # no clipping
    metrics = walk("metrics")()
    assert metrics["step"] == len(SIZES) and metrics["loss"] == losses[-1], metrics
    assert metrics["step_time_s"] > 0 and 0 < metrics["mfu"] <= 1, metrics
    stats = walk("stats")()
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "planned_peak_bytes",
                "comm_bytes_last_step", "compiled_code_bytes", "library_bytes", "runtime_bytes",
                "allocator_free_bytes", "total_bytes",
                "held_bytes_by_dtype"):
        assert key in stats, (key, stats)
    report = walk("memory_report")(file=io.StringIO())  # the same figures, as a table
    assert f"{stats['param_bytes'] / 2**20:.1f}" in report and "measured RSS growth" in report
    # predict at 3 rows (another size): PyTorch with the trained parameters says what it is
    module.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    with torch.no_grad():
        expected = module(x[:3]).numpy()
    assert rel_err(walk("predict")(x[:3].numpy()), expected) <= 1e-5
    # a checkpoint round trip: a fresh Trainer of the same layout continues from it
    walk("load_checkpoint")
    if layout == "plain":  # independent ranks would write one directory's files alike
        try:
            walk("save_checkpoint")(directory / "ckpt-plain")
            raise AssertionError("independent ranks saved into one directory")
        except ValueError as exc:
            assert "local=True" in str(exc), exc
    else:
        saved = walk("save_checkpoint")(directory / f"ckpt-{layout}")
        again = raf_dist.Trainer(raf_dist.frontend.from_pytorch(make("mlp", 8, seed=1)[0], (
            torch.from_numpy(mine(8)[0]),)), optimizer=raf_optimizer("adamw"))
        again.load_checkpoint(saved)
        assert again.step_count == len(SIZES)
        for name, value in again.state_dict().items():
            assert np.array_equal(value, params[name]), name
        assert again.step(*mine(8)) == trainer.step(*mine(8))
    missing = public - walked
    assert not missing, f"public Trainer members this walk does not check: {sorted(missing)}"
    print(f"rank {comm.rank}: SURFACE OK {layout}", flush=True)


if __name__ == "__main__":
    main()

"""Tensor parallelism (composed with data parallelism and ZeRO) vs one process on the global
batch.

Usage: tp_train.py MODEL OPTIMIZER TP ZERO STEPS [--save DIR] [--load DIR] [--microbatches M]
                   [--vocab V] [--recompute full|selective]
World = dp x TP. Every rank passes the slice of the global batch of its data-parallel index;
after STEPS steps losses, full parameters (state_dict) and optimizer state must equal a
single-process run on the global batch (norm-relative <= 5e-5), and the bus bytes on the tp
group must be the plan's: per step one allreduce per g (forward) and per f with a gradient
(backward), the vocabulary-parallel loss's three per row, plus the non-finite guard's verdict
(one float) when the step has one. ``predict`` on 3 rows equals PyTorch's forward with the
trained parameters.
--microbatches M accumulates the gradients of M microbatches per step (one update, the
collectives once). --load resumes from a checkpoint (written at any layout) first; the
reference then covers the loaded steps too. --save writes a checkpoint at the end.
--vocab V: the Hugging Face models (tests/hf.py) with a vocabulary of V; one TP does not
divide is padded: the split parameters hold ceil(V / TP) rows each, predict() and
state_dict() show V, a checkpoint holds V rows and loads back into zero-padded pieces.
--recompute sets activation_checkpointing (passes/remat.py): the same results, and the same
tp traffic (collectives are never recomputed).
Prints 'rank R: TP OK'."""
import re
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import assert_like_one_process, make, raf_optimizer, rel_err  # noqa: E402

GLOBAL_BATCH = 8
TOL = 5e-5  # float reduction order (the tp allreduces too), amplified by Adam: tests/hf.py


def main():
    name, opt_name, tp, zero, steps = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                       int(sys.argv[4]), int(sys.argv[5]))
    flags = dict(zip(sys.argv[6::2], sys.argv[7::2]))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    comm = dist.get_communicator()
    dp = comm.size // tp
    config = dist.get_config()
    config.update({"tensor_parallel_size": tp, "enable_data_parallel": dp > 1 or zero > 0,
                   "zero_opt_level": zero,
                   "num_microbatches": int(flags.get("--microbatches", 1)),
                   "activation_checkpointing": flags.get("--recompute", False)})
    mesh = dist.get_mesh()
    if "--vocab" in flags:  # the reference (models.make on rank 0) builds the same model
        import hf

        assert name.startswith("hf_"), "--vocab is for the Hugging Face models"
        hf.VOCAB = int(flags["--vocab"])
    module, x, y = make(name, GLOBAL_BATCH, seed=0)
    if comm.rank > 0:  # the Trainer must start every rank from rank 0's parameters
        for p in module.parameters():
            p.data.normal_()
    local = GLOBAL_BATCH // dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    xs, ys = x[rows].numpy(), y[rows].numpy()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_optimizer(opt_name))
    if "--recompute" in flags:  # the backward reads recomputed copies (named <value>_re)
        copies = len(re.findall(r"\w_re: ", trainer.executor.ir.script()))
        assert copies > 0, "nothing recomputed"
        if comm.rank == 0:
            print(f"{copies} values recomputed ({flags['--recompute']})")
    loaded = 0
    if "--load" in flags:
        trainer.load_checkpoint(flags["--load"])
        loaded = trainer.step_count
    dist.reset_comm_counters()
    losses = [trainer.step(xs, ys) for _ in range(steps)]
    tp_bytes = dist.comm_counters(group=mesh.tp_group)["allreduce"]["bus_bytes"]

    params, ref_params = assert_like_one_process(trainer, losses, name, opt_name, GLOBAL_BATCH,
                                                 loaded, TOL)

    # predict (here at 3 rows, another batch size: the model split again) gathers the whole
    # output on every rank; PyTorch with the trained parameters says what it must be
    module.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=False)
    with torch.no_grad():
        expected = module(x[:3]).numpy()
    predicted = trainer.predict(x[:3].numpy())
    assert predicted.shape == expected.shape, (predicted.shape, expected.shape)
    assert rel_err(predicted, expected) <= 1e-5

    plan = trainer.tp_plan
    if dp > 1 and zero == 0:  # gradient buckets + the loss, once per step whatever M
        calls = dist.comm_counters(group=mesh.dp_group)["allreduce"]["calls"]
        assert calls == steps * (trainer.num_grad_buckets + 1), (calls, trainer.num_grad_buckets)
    if tp > 1:  # every tp allreduce is per row: microbatches sum to the same bytes
        assert plan.placements, plan.explain()
        guard = 1 if trainer.executor.builder.nonfinite_guard() else 0
        numel = (sum(plan.forward_reduces) + sum(plan.backward_reduces)
                 + sum(plan.loss_reduces) + guard)
        expected = steps * 2 * (tp - 1) / tp * 4 * numel
        assert abs(tp_bytes - expected) < 1e-6, (tp_bytes, expected, plan.explain())
        by_axis = trainer.stats()["comm_bytes_by_axis"]  # the last step's share, on tp
        assert abs(by_axis["tp"] - expected / steps) < 1e-6, (by_axis, expected)
        # the split parameters are held as 1/T pieces (of their padded shape, when padded)
        full = sum(v.nbytes for v in ref_params.values())
        held = trainer.stats()["param_bytes"]
        split = sum(ref_params[n].nbytes for n in plan.placements)
        pieces = sum(np.prod(plan.padded_shape(n)) * ref_params[n].itemsize // tp
                     for n in plan.placements)
        assert held * (1 if zero < 3 else dp) == full - split + pieces, (held, full, split)
        if "--vocab" in flags and int(flags["--vocab"]) % tp:
            assert plan.padding and "padded to" in plan.explain(), plan.explain()
            check_padded_checkpoint(trainer, comm, params)
    if "--save" in flags:
        trainer.save_checkpoint(flags["--save"])
    if comm.rank == 0 and tp > 1:
        print(plan.explain())
    print(f"rank {comm.rank}: TP OK")


def check_padded_checkpoint(trainer, comm, params):
    """A checkpoint of a padded vocabulary holds the true shapes; loaded back, every rank holds
    its padded pieces again (zero padding) and the full state is what it was."""
    import shutil
    import tempfile

    from raf_dist import checkpoint as ckpt

    states = trainer.optimizer_state_dict()
    root = comm.mpi_comm.bcast(tempfile.mkdtemp(prefix="tp_pad_") if comm.rank == 0 else None)
    try:
        directory = trainer.save_checkpoint(root)
        saved = {d["name"]: d["shape"] for d in ckpt.read_meta(ckpt.resolve(root))["model"]}
        assert saved == {n: list(params[n].shape) for n in saved}, saved
        trainer.load_checkpoint(directory)
    finally:
        comm.idle_barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    for name, value in trainer.state_dict().items():
        assert np.array_equal(value, params[name]), name
    for name, by_state in trainer.optimizer_state_dict().items():
        for state, value in by_state.items():
            assert np.array_equal(value, states[name][state]), (name, state)
    plan, held = trainer.tp_plan, trainer.executor._local_params()
    for name, pad in plan.padding.items():  # this rank's rows of the padding are zeros
        rank_rows = pad.padded // plan.tp
        first = dist.get_mesh().tp_rank * rank_rows
        mine = held[name].take(range(max(pad.size - first, 0), rank_rows), axis=pad.dim)
        assert not mine.any(), name


if __name__ == "__main__":
    main()

"""Embedding-table parallelism (passes/embedding_parallel.py) vs one process on the global
batch, and one process vs PyTorch.

Usage: ep_train.py MODE OPTIMIZER STEPS [--save DIR] [--load DIR] [--plan TABLE=RANK]
       [--clip MAX_NORM] [--zero LEVEL] [--budget MB] [--nan-step K]
       [--microbatches M] [--precision fp16|bf16] [--tp T] [--predict ROWS]
MODE: "table" or "row" (or "none": a world of one resuming a checkpoint).
The model is tests/models.py ShardedRec (three EmbeddingBag tables of 40, 60 and 12 rows:
a sum bag with per-sample weights, a mean bag with a padding id, a sum bag; an nn.Embedding
of 25 rows; DLRM's dot interactions). Every rank passes its slice of a global batch of 12.
After STEPS steps:
- the losses, the full parameters (state_dict) and optimizer state equal a single-process
  raf_dist run on the global batch (norm-relative <= 5e-5), and that run equals PyTorch's
  (within 4x PyTorch's own float32-vs-float64 spread on the same steps);
- each rank holds at most 1/N of the table bytes plus the largest table (table-wise) or plus
  one block of every table (row-wise), and the dense parameters whole;
- the all-to-all bytes of a step equal the analytic count (exchange_bytes); the dense
  gradients still travel by allreduce;
--load resumes from a checkpoint (written at any layout) first; the references then cover
the loaded steps too. --save writes a checkpoint at the end. --clip: every run (and PyTorch's,
by clip_grad_norm_) clips the gradients by their global norm, the tables' included: the
reported norm equals one process's on every step. --zero: the dense layers under ZeRO-LEVEL
over the same ranks (the tables held whole by their holders, outside the buckets).
--microbatches M: each rank's slice accumulated over M microbatches (the references take the
whole batch in one step).
--precision: every rank and the reference train in it (the reference's loss scale too);
the tolerance is PRECISION_FACTOR x the one-process run's distance from float32.
--tp T: tensor_parallel_size T (the world is N / T dp ranks x T): the dense layers split
across each dp group's tp ranks, the tables sharded over the dp ranks and held whole by every
tp rank of a group; the counts above are per dp rank.
--predict ROWS: after training, predict() on ROWS other rows (every rank passes them all and
computes a share, the last share padded) equals one process's predict.
--nan-step K: Trainer(nonfinite="skip"), and step K (0-based, not the last) gets a NaN in the
last rank's dense features: every rank returns NaN for it and no rank updates anything (the
tables' rows included), so the run ends where the references' STEPS - 1 good steps end.
Prints 'rank R: EP OK'."""
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
from raf_dist.passes.embedding_parallel import exchange_bytes
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import (make_sharded_rec, raf_optimizer, rel_err, torch_loss,  # noqa: E402
                    torch_optimizer, torch_step)

GLOBAL_BATCH = 12
TOL = 5e-5  # float reduction order (the exchanges' sums too), amplified by Adam: tp_train.py
# the N ranks round other partial sums to 16 bits than one process does, never more often:
# workers/amp_train.py's factor over the low-precision run's distance from float32
PRECISION_FACTOR = 1.5


def torch_reference(opt_name, steps, clip=None):
    """(losses, parameters, spread): PyTorch on the global batch in float32, and the
    norm-relative distance of its float32 parameters from its own float64 run (the
    calibration of the raf_dist-vs-PyTorch tolerance)."""
    runs = {}
    for dtype in (torch.float32, torch.float64):
        module, x, y = make_sharded_rec(GLOBAL_BATCH)
        module = module.to(dtype)
        x = tuple(a.to(dtype) if a.is_floating_point() else a for a in x)
        opt = torch_optimizer(opt_name, module.parameters())
        if clip is None:
            losses = [torch_step(module, opt, x, y) for _ in range(steps)]
        else:
            losses = []
            for _ in range(steps):
                opt.zero_grad()
                loss = torch_loss(module(*x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                opt.step()
                losses.append(loss.item())
        runs[dtype] = (losses, {k: v.detach().double().numpy()
                                for k, v in module.state_dict().items()})
    (losses, params), (_, exact) = runs[torch.float32], runs[torch.float64]
    spread = max(rel_err(params[k], exact[k]) for k in params)
    return losses, {k: v.astype(np.float32) for k, v in params.items()}, spread


def predict_rows(count):
    """``count`` rows of the model's inputs for predict (other ids than the training batch)."""
    return [a.numpy() for a in make_sharded_rec(count, seed=7)[1]]


def train_alone(opt_name, steps, clip=None, precision="fp32", predict=0):
    """(losses, state_dict, optimizer_state_dict, norms, loss scale, predictions on
    ``predict`` rows or None): raf_dist alone on the global batch (the caller's config
    switched to one process)."""
    module, x, y = make_sharded_rec(GLOBAL_BATCH)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, x),
                               optimizer=raf_optimizer(opt_name), local=True,
                               max_grad_norm=clip, precision=precision)
    arrays = [a.numpy() for a in x]
    losses, norms = [], []
    for _ in range(steps):
        losses.append(trainer.step(arrays, y.numpy()))
        norms.append(trainer.last_grad_norm)
    return (losses, trainer.state_dict(), trainer.optimizer_state_dict(), norms,
            trainer.loss_scale, trainer.predict(predict_rows(predict)) if predict else None)


def references(opt_name, steps, clip=None, precision="fp32", predict=0):
    """Rank 0 trains raf_dist alone on the global batch and PyTorch; every rank gets the
    raf_dist run in ``precision`` (losses, state_dict, optimizer_state_dict, norms, loss
    scale, its predictions on ``predict`` rows) and the tolerances {"values": loss and
    parameters, "states": optimizer states}:
    TOL in float32; in fp16 / bf16 PRECISION_FACTOR x the one-process run's largest distance
    from float32 (the size of its rounding on this case, measured in the same run).
    Collective."""
    comm = dist.get_communicator()
    reference = None
    if comm.rank == 0:
        config = dist.get_config()
        saved = config.as_dict()
        config.update({"enable_data_parallel": False, "embedding_parallel": "none",
                       "zero_opt_level": 0, "activation_memory_budget_mb": None,
                       "num_microbatches": 1, "tensor_parallel_size": 1})
        reference = train_alone(opt_name, steps, clip, predict=predict)
        losses = reference[0]
        torch_losses, torch_params, spread = torch_reference(opt_name, steps, clip)
        tol = max(4 * spread, 1e-6)
        assert rel_err(losses, torch_losses) <= tol, (losses, torch_losses, spread)
        for key, value in torch_params.items():
            assert rel_err(reference[1][key], value) <= tol, (key, spread)
        print(f"one process vs PyTorch within {tol:.2g} (PyTorch's float32 vs float64: "
              f"{spread:.2g})")
        tols = {"values": TOL, "states": TOL}
        if precision != "fp32":  # the largest distance from float32 in one process, of the
            # loss and parameters, and of the optimizer states (Adam's first updates hardly
            # depend on the gradients' rounding; its states do), as workers/amp_train.py
            low = train_alone(opt_name, steps, clip, precision, predict)
            values = max([rel_err(low[0], losses)]
                         + [rel_err(v, reference[1][k]) for k, v in low[1].items()])
            states = max([rel_err(v, reference[2][k][state])
                          for k, by_state in low[2].items() for state, v in by_state.items()],
                         default=0.0)
            assert values > 0, f"{precision} gave the float32 result: nothing was low precision"
            tols = {"values": PRECISION_FACTOR * values,
                    "states": PRECISION_FACTOR * max(states, values)}
            reference = low
            print(f"one process in {precision}: {values:.2g} from float32 (states {states:.2g})")
        reference = reference + (tols,)
        config.update({k: saved[k] for k in ("enable_data_parallel", "embedding_parallel",
                                             "zero_opt_level", "num_microbatches",
                                             "tensor_parallel_size")})
    comm.idle_barrier()
    return comm.mpi_comm.bcast(reference, root=0)


def main():
    mode, opt_name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flags = dict(zip(sys.argv[4::2], sys.argv[5::2]))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    comm = dist.get_communicator()
    tp = int(flags.get("--tp", 1))
    n = comm.size // tp  # the dp ranks: the tables are sharded over them
    zero = int(flags.get("--zero", 0))
    if comm.size > 1:
        dist.get_config().update({"enable_data_parallel": True, "embedding_parallel": mode,
                                  "zero_opt_level": zero, "tensor_parallel_size": tp})
        dist.get_config().num_microbatches = int(flags.get("--microbatches", 1))
        if "--budget" in flags:  # the ranks' steps differ (their tables): one agreed policy
            dist.get_config().activation_memory_budget_mb = float(flags["--budget"])
    module, x, y = make_sharded_rec(GLOBAL_BATCH)
    if comm.rank > 0:  # the Trainer must start every rank from rank 0's parameters
        for p in module.parameters():
            p.data.normal_()
    local = GLOBAL_BATCH // n
    dp_rank = dist.get_mesh().dp_rank  # the tp ranks of a dp group read the same rows
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    xs, ys = [a[rows] for a in x], y[rows].numpy()
    plan = None
    if "--plan" in flags:
        table, rank = flags["--plan"].split("=")
        plan = {table: int(rank)}
    clip = float(flags["--clip"]) if "--clip" in flags else None
    nan_step = int(flags["--nan-step"]) if "--nan-step" in flags else None
    precision = flags.get("--precision", "fp32")
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, tuple(xs)),
                               optimizer=raf_optimizer(opt_name), embedding_plan=plan,
                               max_grad_norm=clip,
                               nonfinite="raise" if nan_step is None else "skip",
                               precision=precision)
    assert trainer.executor.parallel.microbatches == int(flags.get("--microbatches", 1))
    loaded = 0
    if "--load" in flags:
        trainer.load_checkpoint(flags["--load"])
        loaded = trainer.step_count
    arrays = [a.numpy() for a in xs]
    bad = [a.copy() for a in arrays]
    if dp_rank == n - 1:  # (every tp rank of that dp group)
        bad[0][0, 0] = np.nan  # the dense features: every gradient behind them turns NaN
    losses, norms = [], []
    for i in range(steps):
        losses.append(trainer.step(bad if i == nan_step else arrays, ys))
        norms.append(trainer.last_grad_norm)
    # skipped steps (the NaN step; fp16: an overflow at the current scale, which N ranks meet
    # where one process does not: each rank's gradients are of its local mean, as in DDP) are
    # NaN on every rank and change nothing: the good steps are the references'
    skipped = [i for i, v in enumerate(losses) if np.isnan(v)]
    assert nan_step is None or nan_step in skipped, (nan_step, losses)
    if precision != "fp16":
        assert skipped == ([] if nan_step is None else [nan_step]), losses
        assert trainer.skipped_steps == len(skipped), trainer.skipped_steps
    if skipped and comm.rank == 0:
        print(f"steps {skipped} skipped on every rank: losses {losses}")
    assert not skipped or steps - len(skipped) >= 2, ("fewer than two good steps", losses)
    losses = [v for i, v in enumerate(losses) if i not in skipped]
    norms = [v for i, v in enumerate(norms) if i not in skipped]
    steps -= len(skipped)

    predict = int(flags.get("--predict", 0))
    ref_losses, ref_params, ref_states, ref_norms, ref_scale, ref_predicted, tols = references(
        opt_name, loaded + steps, clip, precision, predict)
    if precision == "fp16":  # the reference skipped nothing; each skip halved the scale here
        assert ref_scale == 2.0 ** 16 and trainer.loss_scale == ref_scale / 2 ** len(skipped), (
            trainer.loss_scale, ref_scale, skipped)
    if clip is not None:  # the tables' rows counted once, over every rank (checked first:
        # a wrong norm shows as wrong losses from the second step)
        assert rel_err(norms, ref_norms[loaded:]) <= tols["values"], (norms, ref_norms)
        assert min(norms) > clip, ("the case should clip", norms)
        if comm.rank == 0:
            print(f"clipped at {clip}: global norms {[round(v, 4) for v in norms]}")
    assert rel_err(losses, ref_losses[loaded:]) <= tols["values"], (losses, ref_losses)
    params = trainer.state_dict()
    assert list(params) == list(ref_params)
    worst = {"values": rel_err(losses, ref_losses[loaded:]), "states": 0.0}
    for key, value in ref_params.items():
        assert params[key].shape == value.shape, (key, params[key].shape)
        err = rel_err(params[key], value)
        assert err <= tols["values"], (key, err, tols["values"])
        worst["values"] = max(worst["values"], err)
    states = trainer.optimizer_state_dict()
    for key, by_state in ref_states.items():
        for state, value in by_state.items():
            assert states[key][state].shape == value.shape, (key, state)
            err = rel_err(states[key][state], value)
            assert err <= tols["states"], (key, state, err, tols["states"])
            worst["states"] = max(worst["states"], err)
    if comm.rank == 0:
        print("largest distance from one process: " + ", ".join(
            f"{k} {worst[k]:.2g} (tolerance {tols[k]:.2g})" for k in worst))

    if predict:  # every rank computes a share of the rows, its lookups exchanged
        predicted = trainer.predict(predict_rows(predict))
        assert predicted.shape == ref_predicted.shape, (predicted.shape, ref_predicted.shape)
        err = rel_err(predicted, ref_predicted)
        assert err <= tols["values"], (err, tols["values"])
        if comm.rank == 0:
            print(f"predict on {predict} rows: {err:.2g} from one process")

    ep = trainer.executor.ep_plan
    stats = trainer.stats()
    tp_plan = trainer.executor.tp_plan
    if tp > 1:  # the dense layers split, the tables whole on every tp rank
        assert tp_plan is not None and not set(tp_plan.placements) & set(ep.shapes), tp_plan
        print(f"rank {comm.rank}: tp {tp}: split {sorted(tp_plan.placements)}")

    def piece(k, v):  # the elements of parameter k this rank's tp piece holds
        return (int(np.prod(tp_plan.local_shape(k, v.shape))) if tp_plan is not None
                and k in tp_plan.placements else v.size)

    if n > 1:
        assert ep is not None and ep.mode == mode, ep
        # plain SGD and row-wise Adagrad update the looked-up rows in place (no dense table
        # gradient is formed)
        script = trainer.executor.ir.script()
        sparse = {"sgd": "raf_dist.embedding.sgd_rows",
                  "rowwise_adagrad": "raf_dist.embedding.adagrad_rows"}.get(opt_name)
        assert ("raf_dist.embedding." in script) == (sparse is not None), opt_name
        assert sparse is None or sparse in script, (opt_name, sparse)
        tables = {name: params[name].nbytes for name in ep.shapes}
        assert trainer.executor.parallel.zero_level == zero and stats["param_bytes"] > 0
        if opt_name == "rowwise_adagrad":  # one accumulator per row held: of this rank's rows
            expected = sum(4 * (ep.local_rows(k, dp_rank) if k in ep.shapes else
                                v.shape[0] if v.ndim >= 2 else v.size)
                           for k, v in params.items())
            assert stats["optimizer_state_bytes"] == expected, (stats, expected)
        dense = sum(4 * piece(k, v) if zero < 3 else 4 * -(-piece(k, v) // n)  # ZeRO-3: shards
                    for k, v in params.items() if k not in tables)
        held = stats["param_bytes"] - dense
        assert held == ep.held_bytes(dp_rank), (held, ep.held_bytes(dp_rank))
        # gradients held: the dense ones (reduced shards from ZeRO-2 on), and the tables'
        # whole unless updated on their looked-up rows (no whole gradient formed)
        dense_grads = sum(4 * piece(k, v) if zero < 2 else 4 * -(-piece(k, v) // n)
                          for k, v in params.items() if k not in tables)
        expected = dense_grads + (0 if sparse is not None else held)
        assert stats["grad_bytes"] == expected, (stats["grad_bytes"], expected, opt_name)
        if mode == "table":
            bound = sum(tables.values()) / n + max(tables.values())
        else:
            bound = sum(tables.values()) / n + sum(
                ep.block_rows(t) * ep.shapes[t][1] * 4 for t in tables)
        assert held <= bound, (held, bound)
        # the ids each step looks up: three bags of 4 per row, one category per row
        # (ids, bags, per-sample weights): the bags pooled on the holders (table 0 weighted);
        # the category a plain nn.Embedding, its rows travel
        lookups = {"tables.0.weight": [(local * 4, local, True)],
                   "tables.1.weight": [(local * 4, local, False)],
                   "tables.2.weight": [(local * 4, local, False)], "category.weight": [local]}
        expected = exchange_bytes(ep, dp_rank, lookups)
        got = stats["comm_bytes_last_step"].get("alltoall", 0)
        assert got == expected, (got, expected)
        # the dense gradients: allreduced, or reduce-scattered under ZeRO
        assert stats["comm_bytes_last_step"]["reduce_scatter" if zero else "allreduce"] > 0
        if zero:  # the tables' states whole beside the dense layers' flat padded shards
            per_param = len(next(iter(ref_states.values()), {}))
            shards = sum(4 * -(-piece(k, v) // n) for k, v in params.items()
                         if k not in tables)
            expected = per_param * (held + shards)
            assert stats["optimizer_state_bytes"] == expected, (stats, expected)
            print(f"rank {comm.rank}: ZeRO-{zero} dense, optimizer state {expected} bytes")
        if comm.rank == 0:
            print(f"{mode}-wise over {n}: tables {ep.describe()['owners'] or 'split by rows'};"
                  f" rank 0 holds {held} of {sum(tables.values())} table bytes, sends "
                  f"{got} bytes by all-to-all a step")
        if plan is not None:  # the module name placed the table's weight
            (table, rank), = plan.items()
            assert ep.owners[table + ".weight"] == rank, ep.owners

    if "--budget" in flags:
        planned = trainer.stats()["planned_peak_bytes"]
        print(f"budget: rank {comm.rank} recompute {trainer.executor.recompute} planned "
              f"{planned} bytes")
        assert planned <= float(flags["--budget"]) * 2**20, planned
    if "--save" in flags:
        trainer.save_checkpoint(flags["--save"])
    print(f"rank {comm.rank}: EP OK")


if __name__ == "__main__":
    main()

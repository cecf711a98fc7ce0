"""ZeRO-1/2/3 on N ranks vs one process on the same global batch, with DESIGN.md section 3's
accounting.

Usage: zero_train.py MODEL OPTIMIZER[,OPTIMIZER...] BUCKET_MB OVERLAP(0|1) LEVEL[,LEVEL...] [STEPS]
       [ACCOUNTING(0|1)]
Rank 0 trains the reference (one process, data parallel off) on the whole global batch; every
rank then trains each ZeRO level on its slice and compares losses, parameters and optimizer
state (norm-relative <= 2e-5), and checks what stats() reports:
  param_bytes           4 Psi (levels 0-2), 4 Psi/N padded (level 3)
  optimizer_state_bytes K * 4 Psi (level 0), K * 4 Psi/N padded (levels 1-3)
  comm_bytes_last_step  reduce_scatter and allgather (N-1)/N * 4 Psi each (levels 1-2; every
                        tensor travels where it lives, so its shards' padding never does);
                        level 3 gathers the parameters again for backward: allgather between
                        1x and 2x that, total <= 3 Psi (N-1)/N * 4; allreduce only the loss
  reduce_scatter calls  one per gradient bucket per step
  level 0 (plain data parallelism): 2 Psi (N-1)/N * 4 allreduce bytes (+ the loss, the
                        buckets' 64-byte alignment padding included), one allreduce per bucket
                        and one for the loss per step
  peak                  with ACCOUNTING=1 (a model whose parameters dominate its
                        activations, level 0 among LEVEL): params + optimizer state + planned
                        temporaries falls from level to level, and rank 0 checks
                        raf_dist.estimate_memory against stats() (within 10%)
Prints 'rank R: ALL OK' once every optimizer passed."""
import sys

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 12  # divides by 2, 3 and 4


def main():
    name, opts, bucket_mb, overlap = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
    levels = [int(v) for v in sys.argv[5].split(",")]
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 6
    accounting = len(sys.argv) > 7 and sys.argv[7] == "1"
    for opt_name in opts.split(","):
        check(name, opt_name, bucket_mb, overlap, levels, steps, accounting)
    print(f"rank {dist.get_communicator().rank}: ALL OK")


def check(name, opt_name, bucket_mb, overlap, levels, steps, accounting):
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    ref_losses, ref_params, ref_states = single_process_reference(name, opt_name, GLOBAL_BATCH, steps)
    numels = [v.size for v in ref_params.values()]
    psi = sum(numels)
    shard = sum(-(-k // n) for k in numels)  # padded shard elements per rank
    assert 0 <= shard * n - psi < n * len(numels)
    per_param = len(next(iter(ref_states.values()))) if ref_states else 0
    totals = {}
    for level in levels:
        module, x, y = make(name, GLOBAL_BATCH, seed=0)
        if rank > 0:  # a different start on every rank: the Trainer broadcasts rank 0's
            for p in module.parameters():
                p.data.normal_()
        local = GLOBAL_BATCH // n
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                                  "bucket_size_mb": bucket_mb, "overlap_comm": overlap})
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                                   optimizer=raf_optimizer(opt_name))
        before = dist.comm_counters()
        losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
        after = dist.comm_counters()
        what = f"{name} {opt_name} level {level} N={n}"
        assert rel_err(losses, ref_losses) <= 2e-5, (what, losses, ref_losses)
        params = trainer.state_dict()  # gathers under ZeRO-3: every rank calls it
        for key, value in ref_params.items():
            assert params[key].shape == value.shape, (what, key)
            assert rel_err(params[key], value) <= 2e-5, (what, key, rel_err(params[key], value))
        states = trainer.optimizer_state_dict()
        for key, by_state in ref_states.items():
            for state, value in by_state.items():
                assert states[key][state].shape == value.shape, (what, key, state)
                err = rel_err(states[key][state], value)
                assert err <= 2e-5, (what, key, state, err)

        stats = trainer.stats()
        comm_bytes = stats["comm_bytes_last_step"]
        loss_bytes = 2 * (n - 1) / n * 4
        if n == 1:
            loss_bytes = 0.0
        held = 4 * (shard if level == 3 else psi)
        assert stats["param_bytes"] == held, (what, stats)
        assert stats["optimizer_state_bytes"] == per_param * 4 * (shard if level else psi), (what, stats)
        if level == 0:  # buckets hold gradients at 64-byte aligned offsets (in place)
            padded = sum(raf_dist.passes.bucket_layout([numels[i] for i in b], 4)[1]
                         for b in trainer.grad_buckets)
            assert psi <= padded < psi + 16 * len(numels), (psi, padded)
            assert abs(comm_bytes["allreduce"] - 2 * (n - 1) / n * 4 * (padded + 1)) < 1e-6, (what, stats)
            calls = after["allreduce"]["calls"] - before["allreduce"]["calls"]
            assert calls == steps * (trainer.num_grad_buckets + 1), (what, calls)  # + the loss
        else:
            one_pass = (n - 1) / n * 4 * psi
            assert abs(comm_bytes.get("allreduce", 0.0) - loss_bytes) < 1e-6, (what, stats)
            # 1e-9: the counters sum one float per collective call
            assert abs(comm_bytes.get("reduce_scatter", 0.0) - one_pass) <= 1e-9 * one_pass, (
                what, stats, one_pass)
            gathered = comm_bytes.get("allgather", 0.0)
            if level < 3:
                assert abs(gathered - one_pass) <= 1e-9 * one_pass, (what, stats, one_pass)
            else:
                bound = 1 + 1e-9  # as above
                assert (one_pass < gathered or n == 1) and gathered <= 2 * one_pass * bound, (
                    what, stats)
                assert sum(comm_bytes.values()) - loss_bytes <= 3 * one_pass * bound
            rs_calls = after["reduce_scatter"]["calls"] - before["reduce_scatter"]["calls"]
            assert rs_calls == steps * trainer.num_grad_buckets, (what, rs_calls)
            assert trainer.num_grad_buckets >= 2 or n == 1, "the case should have several buckets"
        if accounting and rank == 0:  # the estimator agrees within 10%
            estimate = raf_dist.estimate_memory(trainer.model, raf_optimizer(opt_name), n, level,
                                                bucket_size_mb=bucket_mb)
            for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes",
                        "planned_peak_bytes"):
                assert abs(estimate[key] - stats[key]) <= 0.1 * stats[key], (what, key, estimate,
                                                                             stats)
        totals[level] = (stats["param_bytes"] + stats["optimizer_state_bytes"]
                         + stats["planned_peak_bytes"])
    if accounting:
        ordered = [totals[level] for level in sorted(totals)]
        assert all(a > b for a, b in zip(ordered, ordered[1:])), (name, opt_name, totals)
        if rank == 0:
            print(f"peak bytes by level (N={n}, {name}, {opt_name}): {totals}")


if __name__ == "__main__":
    main()

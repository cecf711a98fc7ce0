"""Data-parallel training on N ranks vs one process on the same global batch.

Usage: dp_train.py MODEL OPTIMIZER[,OPTIMIZER...] BUCKET_MB OVERLAP(0|1) [STEPS]
Each rank trains on its slice; then it builds a single-process Trainer (data parallel off) on
the whole global batch and compares losses and parameters (norm-relative <= 2e-5), checks the
collective count (buckets + the loss) and the bus bytes (2 Psi (N-1)/N * 4 + the loss).
Prints 'rank R: ALL OK buckets=B' once every optimizer passed."""
import sys

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 12  # divides by 2, 3 and 4


def main():
    name, bucket_mb, overlap = sys.argv[1], float(sys.argv[3]), sys.argv[4] == "1"
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 6
    for opt_name in sys.argv[2].split(","):
        buckets = check(name, opt_name, bucket_mb, overlap, steps)
    print(f"rank {dist.get_communicator().rank}: ALL OK buckets={buckets}")


def check(name, opt_name, bucket_mb, overlap, steps):
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    # each rank seeds torch differently: the Trainer must broadcast rank 0's parameters
    module, x, y = make(name, GLOBAL_BATCH, seed=0)
    if rank > 0:
        for p in module.parameters():
            p.data.normal_()
    local = GLOBAL_BATCH // n
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    config = dist.get_config()
    config.update({"enable_data_parallel": True, "bucket_size_mb": bucket_mb, "overlap_comm": overlap})
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)), optimizer=raf_optimizer(opt_name))
    dist.reset_comm_counters()
    losses = [trainer.step(xs.numpy(), ys.numpy()) for _ in range(steps)]
    counters = dist.comm_counters()["allreduce"]
    last = trainer.stats()["comm_bytes_last_step"]

    # the reference: one process, the global batch
    ref_losses, ref_params, _ = single_process_reference(name, opt_name, GLOBAL_BATCH, steps)

    # float32 sums in a different order per rank count: ~1e-7 per step; 2e-5 after 6 steps
    assert rel_err(losses, ref_losses) <= 2e-5, (losses, ref_losses)
    params = trainer.state_dict()
    for key, value in ref_params.items():
        assert rel_err(params[key], value) <= 2e-5, (key, rel_err(params[key], value))

    psi = sum(v.size for v in ref_params.values())
    # each bucket holds its gradients at 64-byte aligned offsets (compiled kernels write them
    # there in place): at most 15 float32 of padding per gradient travel with them
    numels = [v.size for v in ref_params.values()]
    padded = sum(raf_dist.passes.bucket_layout([numels[i] for i in bucket], 4)[1]
                 for bucket in trainer.grad_buckets)
    assert psi <= padded < psi + 16 * len(numels), (psi, padded)
    expected_step_bytes = 2 * (n - 1) / n * 4 * (padded + 1)  # gradients + the loss scalar
    assert abs(last["allreduce"] - expected_step_bytes) < 1e-6, (last, expected_step_bytes)
    sizes = [4 * v.size for v in ref_params.values()]
    buckets = len(raf_dist.passes.assign_buckets(sizes[::-1], int(bucket_mb * 2**20)))
    assert counters["calls"] == steps * (buckets + 1), (counters, buckets)
    return buckets


if __name__ == "__main__":
    main()

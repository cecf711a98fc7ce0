"""BatchNorm under pipelining: a residual CNN with BatchNorm after every convolution, in 2
stages of M = 2 microbatches, alone (2 ranks) or with data parallelism (pp 2 x dp 2, 4 ranks).

Usage: pp_bn_train.py SYNC STEPS DIR   (SYNC: 1 for sync_batch_norm, 0 for DDP's buffers;
       DIR: where a checkpoint is saved and loaded back)
Each microbatch is normalised by its own statistics (as PyTorch's gradient accumulation), and
every stage updates its running statistics once per microbatch, in order. Compared with one
process (a local Trainer) that accumulates over the same chunks of the global batch:
- no dp, or dp with sync_batch_norm: microbatch m is chunk m of every dp rank together, so
  one process with M microbatches over the rows arranged that way gives the same losses,
  parameters and running statistics;
- dp without sync: each (dp rank, microbatch) chunk is one microbatch of the reference (dp x M
  of them): the same losses and parameters; the running statistics kept are dp rank 0's
  (DDP's broadcast_buffers), after the first step those of PyTorch's train-mode forward over
  rank 0's two chunks from the initial parameters.
Tolerance: TOL below. Prints 'rank R: PP BN OK'."""
import sys

import numpy as np
import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err  # noqa: E402

GLOBAL_BATCH, M, PP = 8, 2, 2
# float32 reduction order only: both sides are raf_dist's kernels on the same chunks (the
# stages compute the same sums; dp's gradient average and sync_batch_norm's statistics sum
# in another order). Measured 2026-11-25 (3 steps, this 2-core machine): losses <= 7e-8
# apart, parameters <= 5e-7 (sync, dp 2), 0 without dp; 1e-5 leaves a 20x margin.
TOL = 1e-5


def local_reference(x, y, order, microbatches, steps):
    """Rank 0 alone: a local Trainer with ``microbatches`` microbatches over the rows
    ``order`` of the global batch; (losses, state_dict, buffers_dict) broadcast."""
    comm = dist.get_communicator()
    result = None
    if comm.rank == 0:
        config = dist.get_config()
        saved = config.as_dict()
        config.update({"enable_data_parallel": False, "zero_opt_level": 0,
                       "pipeline_parallel_size": 1, "num_microbatches": microbatches,
                       "sync_batch_norm": False})
        module = make("res_bn", GLOBAL_BATCH, seed=0)[0]
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[order],)),
                                   optimizer=raf_optimizer("sgd_momentum"), local=True)
        losses = [trainer.step(x[order].numpy(), y[order].numpy()) for _ in range(steps)]
        result = losses, trainer.state_dict(), trainer.buffers_dict()
        config.update({k: saved[k] for k in ("enable_data_parallel", "zero_opt_level",
                                             "pipeline_parallel_size", "num_microbatches",
                                             "sync_batch_norm")})
    comm.idle_barrier()
    return comm.mpi_comm.bcast(result, root=0)


def main():
    sync, steps = sys.argv[1] == "1", int(sys.argv[2])
    torch.set_num_threads(1)
    comm = dist.get_communicator()
    dp = comm.size // PP
    module, x, y = make("res_bn", GLOBAL_BATCH, seed=0)
    local = GLOBAL_BATCH // dp
    chunk = local // M
    # the global rows of (dp rank r, microbatch m)
    chunks = {(r, m): list(range(r * local + m * chunk, r * local + (m + 1) * chunk))
              for r in range(dp) for m in range(M)}
    if dp == 1 or sync:  # microbatch m: chunk m of every dp rank
        order = [i for m in range(M) for r in range(dp) for i in chunks[(r, m)]]
        ref_losses, ref_params, ref_buffers = local_reference(x, y, order, M, steps)
    else:  # every (dp rank, microbatch) chunk a microbatch of its own
        order = [i for r in range(dp) for m in range(M) for i in chunks[(r, m)]]
        ref_losses, ref_params, _ = local_reference(x, y, order, dp * M, steps)
    config = dist.get_config()
    config.update({"pipeline_parallel_size": PP, "num_microbatches": M,
                   "enable_data_parallel": dp > 1, "sync_batch_norm": sync})
    mesh = dist.get_mesh()
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_optimizer("sgd_momentum"))
    losses = [trainer.step(x[rows].numpy(), y[rows].numpy())]
    buffers = trainer.buffers_dict()
    if dp > 1 and not sync:  # dp rank 0's chain of microbatches from the initial parameters
        first = make("res_bn", GLOBAL_BATCH, seed=0)[0].train()
        with torch.no_grad():
            for m in range(M):
                first(x[chunks[(0, m)]])
        for name, value in first.named_buffers():
            assert rel_err(buffers[name], value.numpy()) <= TOL, (name, buffers[name], value)
    losses += [trainer.step(x[rows].numpy(), y[rows].numpy()) for _ in range(steps - 1)]
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    params = trainer.state_dict()
    worst = max(rel_err(params[name], value) for name, value in ref_params.items())
    assert worst <= TOL, {name: rel_err(params[name], value) for name, value in ref_params.items()}
    buffers = trainer.buffers_dict()
    assert list(buffers) == [n for n, _ in module.named_buffers()], list(buffers)
    if dp == 1 or sync:
        for name, value in ref_buffers.items():
            assert rel_err(buffers[name], value) <= TOL, (name, rel_err(buffers[name], value))
    everyone = comm.mpi_comm.allgather(buffers)  # the same running statistics on every rank
    for theirs in everyone:
        assert all(np.array_equal(theirs[n], buffers[n]) for n in buffers)
    # a checkpoint holds every stage's running statistics: one more step, then the load
    # brings them back
    saved = trainer.save_checkpoint(sys.argv[3])
    trainer.step(x[rows].numpy(), y[rows].numpy())
    trainer.load_checkpoint(saved)
    assert all(np.array_equal(v, buffers[n]) for n, v in trainer.buffers_dict().items())
    # predict uses the running statistics (evaluation mode), as PyTorch's eval()
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                            {**params, **buffers}.items()})
    with torch.no_grad():
        expected = module.eval()(x[:3]).numpy()
    assert rel_err(trainer.predict(x[:3].numpy()), expected) <= 1e-5
    print(f"rank {comm.rank}: PP BN OK (sync={sync}, dp={dp}) losses "
          f"{rel_err(losses, ref_losses):.1e} apart, parameters at most {worst:.1e}", flush=True)


if __name__ == "__main__":
    main()

"""Elastic restart through raf_dist.run (or the same script under mpiexec).
Usage: elastic_train.py DIR [KILL_STEP]

6 data-parallel ZeRO-1 steps of ckpt_train's model, a checkpoint in DIR/ckpt after every step;
a run that finds a checkpoint resumes from it. With KILL_STEP, rank 1 SIGKILLs itself inside
that step in the first attempt (RAF_DIST_RESTART_COUNT unset or 0). Rank 0 writes the final
parameters to DIR/final.npz. Prints 'rank R: ALL OK (attempt A, resumed at step S)'."""
import os
import signal
import sys
from pathlib import Path

import numpy as np

from ckpt_train import trainer
from raf_dist import distributed as dist

STEPS = 6


def main():
    directory = Path(sys.argv[1])
    kill_step = int(sys.argv[2]) if len(sys.argv) > 2 else None
    attempt = int(os.environ.get("RAF_DIST_RESTART_COUNT", "0"))
    comm = dist.get_communicator()
    t, xs, ys = trainer(1)
    resumed = 0
    if (directory / "ckpt" / "latest").exists():
        t.load_checkpoint(directory / "ckpt")
        resumed = t.step_count
    step_fn = t.executor._step_fn

    def step(*args):
        if comm.rank == 1 and attempt == 0 and t.step_count + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return step_fn(*args)

    t.executor._step_fn = step
    while t.step_count < STEPS:
        t.step(xs, ys)
        t.save_checkpoint(directory / "ckpt")
    params = t.state_dict()
    if comm.rank == 0:
        np.savez(directory / "final.npz", **params)
    print(f"rank {comm.rank}: ALL OK (attempt {attempt}, resumed at step {resumed})", flush=True)


if __name__ == "__main__":
    main()

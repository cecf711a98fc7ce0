"""Checkpoints and failures on N ranks. Usage: ckpt_train.py MODE DIR [ARGS...]

  resume LEVEL          6 uninterrupted steps vs 3 + save + load (fresh Trainer) + 3: bitwise
  save LEVEL            3 steps, then save to DIR (the first half of a reshard)
  load LEVEL            load DIR (written by any N and level), 3 more steps; compare with one
                        process running 6 steps on the global batch (<= 2e-5)
  kill_in_save LEVEL    save at step 2, step, then rank 0 dies (SIGKILL) inside the next save
                        after every shard is written; DIR/expected.npz holds the step-2 params
  check_saved LEVEL     load DIR and compare with DIR/expected.npz (bitwise)
  mismatch              rank 1 builds its Trainer with another learning rate
Prints 'rank R: ALL OK' on success."""
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch

import raf_dist
from raf_dist import checkpoint as ckpt
from raf_dist import distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer, rel_err, single_process_reference  # noqa: E402

GLOBAL_BATCH = 12
MODEL, OPT = "mlp", "adamw"


def trainer(level, seed=0, lr=None):
    """This rank's Trainer and slice of the (fixed) global batch; ``seed`` != 0 starts from
    other parameters."""
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    module, x, y = make(MODEL, GLOBAL_BATCH, seed=0)
    if seed:
        torch.manual_seed(seed)
        for p in module.parameters():
            p.data.normal_()
    local = GLOBAL_BATCH // n
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                              "bucket_size_mb": 0.001})
    opt = raf_optimizer(OPT) if lr is None else raf_dist.optim.AdamW(lr=lr)
    model = raf_dist.frontend.from_pytorch(module, (xs,))
    return raf_dist.Trainer(model, optimizer=opt), xs.numpy(), ys.numpy()


def main():
    mode, directory = sys.argv[1], Path(sys.argv[2])
    arg = sys.argv[3] if len(sys.argv) > 3 else None
    comm = dist.get_communicator()
    if mode == "resume":
        level = int(arg)
        t, xs, ys = trainer(level)
        full = [t.step(xs, ys) for _ in range(6)]
        expected, expected_states = t.state_dict(), t.optimizer_state_dict()
        t, xs, ys = trainer(level)
        first = [t.step(xs, ys) for _ in range(3)]
        t.save_checkpoint(directory, extra={"batch": 3})
        t, xs, ys = trainer(level, seed=7)  # other initial parameters: all must come from disk
        assert t.load_checkpoint(directory) == {"batch": 3}
        second = [t.step(xs, ys) for _ in range(3)]
        assert first + second == full, (first + second, full)
        for key, value in t.state_dict().items():
            assert np.array_equal(value, expected[key]), key
        for key, states in t.optimizer_state_dict().items():
            for state, value in states.items():
                assert np.array_equal(value, expected_states[key][state]), (key, state)
    elif mode == "save":
        t, xs, ys = trainer(int(arg))
        for _ in range(3):
            t.step(xs, ys)
        t.save_checkpoint(directory)
    elif mode == "load":
        ref_losses, ref_params, _ = single_process_reference(MODEL, OPT, GLOBAL_BATCH, 6)
        t, xs, ys = trainer(int(arg), seed=7)
        t.load_checkpoint(directory)
        assert t.step_count == 3
        losses = [t.step(xs, ys) for _ in range(3)]
        assert rel_err(losses, ref_losses[3:]) <= 2e-5, (losses, ref_losses[3:])
        for key, value in t.state_dict().items():
            assert rel_err(value, ref_params[key]) <= 2e-5, (key, rel_err(value, ref_params[key]))
    elif mode == "kill_in_save":
        t, xs, ys = trainer(int(arg))
        for _ in range(2):
            t.step(xs, ys)
        t.save_checkpoint(directory)
        params = t.state_dict()
        if comm.rank == 0:
            np.savez(directory / "expected.npz", **params)
        t.step(xs, ys)
        real_finalize = ckpt.files.finalize

        def die(*args, **kwargs):  # every shard is on disk; rank 0 dies before the rename
            os.kill(os.getpid(), signal.SIGKILL)
            return real_finalize(*args, **kwargs)

        ckpt.files.finalize = die
        t.save_checkpoint(directory)
        raise AssertionError("the save should have killed rank 0")
    elif mode == "check_saved":
        t, xs, ys = trainer(int(arg), seed=7)
        t.load_checkpoint(directory)
        assert t.step_count == 2
        expected = np.load(directory / "expected.npz", allow_pickle=False)
        for key, value in t.state_dict().items():
            assert np.array_equal(value, expected[key]), key
    elif mode == "mismatch":
        trainer(1, lr=1e-3 if comm.rank == 1 else None)
        raise AssertionError("mismatched ranks must not start")
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(f"rank {comm.rank}: ALL OK", flush=True)


if __name__ == "__main__":
    main()

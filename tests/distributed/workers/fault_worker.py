"""Fault injection on 2 ranks (tests/distributed/test_faults.py). Usage:

    fault_worker.py DIR RANK HOW WHEN

Every run trains the MLP of tests/models.py with ZeRO-2 for 2 steps, saves a checkpoint
(step 2) into DIR, writes what it holds to DIR/expected.npz (rank 0), runs step 3, then rank
RANK injects HOW at WHEN:

  HOW   kill    SIGKILL itself (runs no code: its watchdog must name it)
        term    SIGTERM itself (default disposition: dies without a word, as kill)
        raise   raise RuntimeError (unhandled: the abort path)
        caught  raise RuntimeError that the script catches and then goes on (the failure must
                still end the job: Communicator.collective_work)
        exit    sys.exit(0) between steps 3 and 4 (WHEN: between): the program ends
                normally while the others still need it
        stall   sleep (alive, silent): the others' collective timeout must end the job
        enospc  (WHEN: save:write) this rank's checkpoint write fails with "No space left on
                device": every rank must raise the same CheckpointError, keep the previous
                checkpoint, and the job may go on (it trains on, saves again, prints
                "rank R: survived")
  WHEN  compile         while a second Trainer compiles its step
        step            at the start of step 4 (the others wait in its first collective)
        collective      inside step 4, between a gradient collective's start and its wait
        save:write      in the save of step 4, before writing this rank's file
        save:finalize   (rank 0) every file written, before meta.json and the rename
        save:latest     (rank 0) the step directory in place, before `latest` moves
        load            while a fresh Trainer reads the step-2 checkpoint
        thread          (raise only) an exception in a thread the script started

Prints "FAULT <rank> <unix time>" right before the fault, and "rank R: survived" if it ever
gets past it (it must not)."""
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tvm_ffi

import raf_dist
from raf_dist import checkpoint as ckpt
from raf_dist import distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import make, raf_optimizer  # noqa: E402

GLOBAL_BATCH = 8


def build(level):
    comm = dist.get_communicator()
    module, x, y = make("mlp", GLOBAL_BATCH, seed=0)
    local = GLOBAL_BATCH // comm.size
    xs, ys = x[comm.rank * local:(comm.rank + 1) * local], y[comm.rank * local:(comm.rank + 1) * local]
    dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                              "bucket_size_mb": 0.001})
    model = raf_dist.frontend.from_pytorch(module, (xs,))
    return raf_dist.Trainer(model, optimizer=raf_optimizer("adamw")), xs.numpy(), ys.numpy()


def fault(how, comm):
    print(f"FAULT {comm.rank} {time.time():.3f}", flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # the signal is delivered at once
    elif how in ("raise", "caught"):
        raise RuntimeError("injected failure")
    elif how == "exit":
        sys.exit(0)
    elif how == "enospc":
        raise OSError(28, "No space left on device")  # as write() reports a full disk
    elif how == "stall":
        time.sleep(600)
    raise SystemExit(f"unknown HOW {how}")


class Armed:
    """Injects the fault the first time ``hit()`` is called while armed, on the failing rank."""

    def __init__(self, how, comm, failing):
        self.how, self.comm, self.on = how, comm, False
        self.failing = comm.rank == failing

    def hit(self):
        if self.on and self.failing:
            self.on = False
            fault(self.how, self.comm)


def main():
    directory, failing, how, when = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    comm = dist.get_communicator()
    armed = Armed(how, comm, failing)

    # "collective": the compiled step waits on its gradient collectives through this global
    # function; the VM resolves it when it is created, so the wrapper goes in first
    real_wait = tvm_ffi.get_global_func("raf_dist.ccl.wait")

    def wait(handle, *buffers):
        if when == "collective":
            armed.hit()
        return real_wait(handle, *buffers)

    tvm_ffi.register_global_func("raf_dist.ccl.wait", wait, override=True)

    t, xs, ys = build(2)
    for _ in range(2):
        t.step(xs, ys)
    t.save_checkpoint(directory)
    params, states = t.state_dict(), t.optimizer_state_dict()
    if comm.rank == 0:
        np.savez(directory / "expected.npz", **{f"param/{k}": v for k, v in params.items()},
                 **{f"state/{k}/{s}": v for k, d in states.items() for s, v in d.items()})
    t.step(xs, ys)

    def attempt(action):
        armed.on = True
        if how != "caught":
            return action()
        try:
            return action()
        except RuntimeError as exc:  # the user's script carries on as if nothing happened
            print(f"rank {comm.rank}: caught {exc}", flush=True)
        for _ in range(3):  # ... and the job must end anyway
            t.step(xs, ys)
        return None

    if how == "exit":
        if comm.rank == failing:
            fault(how, comm)
        for _ in range(3):
            t.step(xs, ys)
    elif how == "enospc":
        real_write = ckpt.files.write_rank_file

        def write_rank_file(*args, **kwargs):
            armed.hit()
            return real_write(*args, **kwargs)

        ckpt.files.write_rank_file = write_rank_file
        t.step(xs, ys)
        armed.on = True
        try:
            t.save_checkpoint(directory)
            raise AssertionError("the save should have failed")
        except ckpt.CheckpointError as exc:
            print(f"rank {comm.rank}: refused: {exc}", flush=True)
        assert (directory / "latest").read_text().strip() == "step-00000002"
        if comm.rank == 0:  # rank 0 removes it, after the ranks agreed on the failure
            assert not list(directory.glob(".tmp-step-*")), "the failed save left its temporary"
        t.step(xs, ys)
        assert t.save_checkpoint(directory).name == "step-00000005"
    elif when == "compile":
        import raf_dist.runtime.spmd_build as spmd  # the SPMD executor's build compiles

        real_compile = spmd.compile_step

        def compile_step(*args, **kwargs):
            armed.hit()
            return real_compile(*args, **kwargs)

        spmd.compile_step = compile_step
        attempt(lambda: build(1))
    elif when in ("step", "collective"):
        if when == "step":
            variant = t.executor._variants[t.batch_size]
            real_step = variant.step_fn

            def step_fn(*args):
                armed.hit()
                return real_step(*args)

            variant.step_fn = step_fn
        attempt(lambda: t.step(xs, ys))
    elif when.startswith("save:"):
        target = {"write": "write_rank_file", "finalize": "finalize",
                  "latest": "_write_latest"}[when[5:]]
        real = getattr(ckpt.files, target)

        def patched(*args, **kwargs):
            armed.hit()
            return real(*args, **kwargs)

        setattr(ckpt.files, target, patched)
        t.step(xs, ys)
        attempt(lambda: t.save_checkpoint(directory))
    elif when == "load":
        fresh, _, _ = build(2)
        real_read = ckpt.files.read_range

        def read_range(*args, **kwargs):
            armed.hit()
            return real_read(*args, **kwargs)

        ckpt.files.read_range = read_range
        attempt(lambda: fresh.load_checkpoint(directory))
    elif when == "thread":
        armed.on = True
        worker = threading.Thread(target=armed.hit, name="loader")
        worker.start()
        worker.join()
        for _ in range(3):
            t.step(xs, ys)
    else:
        raise SystemExit(f"unknown WHEN {when}")
    for _ in range(2):  # steps need every rank: none can get past a fault elsewhere
        t.step(xs, ys)
    print(f"rank {comm.rank}: survived", flush=True)


if __name__ == "__main__":
    main()

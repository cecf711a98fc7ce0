"""A pipeline step taken apart, rank by rank: its F and B actions, the stages' VM calls inside
them, and the time before, between and after the schedule's actions.

    .venv/bin/mpiexec --bind-to core -n 2 .venv/bin/python bench/pipeline_stages.py [--tp 1]
        [--pp 2] [--microbatches 4] [--steps 30] [--warmup 15]

Model: bench/step_time.py's GPT, global batch 16 split over the dp ranks, AdamW (as
bench/plan_validation.py's pipeline meshes). Each rank reads the executor's timeline of every
step (``PipelineExecutor.last_timeline``: each F / B action's start and end) and wraps its
stages' VM functions with a clock; rank 0 prints per rank the medians over ``--steps`` steps
after ``--warmup``: the step, the F and B actions' sums, the VM calls inside them (the rest
of an action is the schedule's Python: handing tensors over, bookkeeping), the time from the
step's start to its first action (the rows check, posting receives; on a later stage the wait
for the first microbatch), after its last (the update, the finite check, the loss broadcast;
on an earlier stage's ranks the wait for the last stage), and between actions (waiting for
messages: the bubble). Set against the cost model's compute of each stage
(raf_dist.proxies' extraction of the same mesh simulated: ``python -m raf_dist.proxies``'s
``--list``, or bench/plan_validation.py).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GLOBAL_BATCH = 16
COLUMNS = ("step", "F", "B", "VM calls", "before", "after", "between")


class _Clocked(dict):
    """A stage's ``{name: VM function}`` whose functions add their wall time to ``total``."""

    def __init__(self, functions, total):
        super().__init__(functions)
        self.total = total

    def __getitem__(self, name):
        fn = dict.__getitem__(self, name)

        def call(*args):
            began = time.perf_counter()
            out = fn(*args)
            self.total[0] += time.perf_counter() - began
            return out

        return call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=15)
    a = p.parse_args()
    import raf_dist
    from raf_dist import distributed as dist
    from step_time import make

    comm = dist.get_communicator()
    if comm.size % (a.tp * a.pp) or a.pp < 2:
        raise SystemExit(f"--tp {a.tp} x --pp {a.pp} (pp >= 2) must divide the {comm.size} ranks")
    dp = comm.size // (a.tp * a.pp)
    dist.get_config().update({"tensor_parallel_size": a.tp, "pipeline_parallel_size": a.pp,
                              "enable_data_parallel": dp > 1,
                              "num_microbatches": a.microbatches})
    mesh = dist.get_mesh()
    module, x, y = make("gpt")
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // dp, (mesh.dp_rank + 1) * GLOBAL_BATCH // dp)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3))
    executor = trainer.executor
    xs, ys = x[rows].numpy(), y[rows].numpy()
    trainer.step(xs, ys)  # builds this rank's stages
    in_vm = [0.0]
    for stage_set in executor._stage_sets.values():
        for stage in stage_set.stages.values():
            stage.vm = _Clocked(stage.vm, in_vm)
    samples = []
    for _ in range(a.warmup + a.steps):
        in_vm[0] = 0.0
        began = time.perf_counter()
        trainer.step(xs, ys)
        ended = time.perf_counter()
        actions = executor.last_timeline  # (kind, stage, microbatch, start, end)
        forward = sum(e - b for kind, _, _, b, e in actions if kind == "F")
        backward = sum(e - b for kind, _, _, b, e in actions if kind == "B")
        first, last = min(b for *_, b, _ in actions), max(e for *_, e in actions)
        samples.append((ended - began, forward, backward, in_vm[0], first - began,
                        ended - last, last - first - forward - backward))
    samples = samples[a.warmup:]
    medians = [statistics.median(s[i] for s in samples) * 1e3 for i in range(len(COLUMNS))]
    every = comm.mpi_comm.gather(medians, root=0)
    if comm.rank == 0:
        print(f"# tp {a.tp} x pp {a.pp} x dp {dp}, {a.microbatches} microbatches, "
              f"{comm.size} ranks; ms, medians of {a.steps} steps after {a.warmup}")
        print("rank pp " + " ".join(f"{c:>9}" for c in COLUMNS))
        for rank, values in enumerate(every):
            pp_rank = rank // (a.tp * dp)
            print(f"{rank:>4} {pp_rank:>2} " + " ".join(f"{v:>9.2f}" for v in values))


if __name__ == "__main__":
    main()

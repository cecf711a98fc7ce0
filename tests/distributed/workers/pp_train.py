"""Pipeline parallelism (composed with data and tensor parallelism, ZeRO-1) vs one process on
the global batch.

Usage: pp_train.py MODEL OPTIMIZER PP TP ZERO STEPS [--microbatches M] [--schedule S]
       [--stages-per-rank V] [--checkpointing 1|selective] [--budget MB] [--split-points a,b] [--save DIR]
       [--load DIR]
World = pp x dp x tp. Every rank passes the slice of the global batch of its data-parallel
index (all stages the same arrays). After STEPS steps the losses (on every rank), the full
parameters (state_dict) and the optimizer state must equal a single-process run on the global
batch (norm-relative <= 5e-5). Each stage's peak of saved microbatches is the schedule's:
min(P - s, M) under 1F1B, M under GPipe, never more than M. --load resumes from a checkpoint
written at any layout (the reference then covers the loaded steps too); --save writes one at
the end. Prints 'rank R: PP OK'."""
import sys

import torch

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import assert_like_one_process, make, raf_optimizer  # noqa: E402

GLOBAL_BATCH = 8
TOL = 5e-5


def main():
    name, opt_name, pp, tp, zero, steps = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                           int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    flags = dict(zip(sys.argv[7::2], sys.argv[8::2]))
    torch.set_num_threads(1)
    comm = dist.get_communicator()
    dp = comm.size // (pp * tp)
    microbatches = int(flags.get("--microbatches", 1))
    schedule = flags.get("--schedule", "1f1b")
    config = dist.get_config()
    config.update({"pipeline_parallel_size": pp, "tensor_parallel_size": tp,
                   "enable_data_parallel": dp > 1 or zero > 0, "zero_opt_level": zero,
                   "num_microbatches": microbatches, "pipeline_schedule": schedule,
                   "activation_checkpointing": {"1": True, "selective": "selective"}.get(
                       flags.get("--checkpointing"), False)})
    if "--budget" in flags:  # recomputation chosen per stage (runtime/stage_budget.py)
        config.activation_memory_budget_mb = float(flags["--budget"])
    if "--stages-per-rank" in flags:
        config.pipeline_stages_per_rank = int(flags["--stages-per-rank"])
    if "--split-points" in flags:
        config.pipeline_split_points = flags["--split-points"].split(",")
    mesh = dist.get_mesh()
    module, x, y = make(name, GLOBAL_BATCH, seed=0)
    if comm.rank > 0:  # the Trainer must start every rank from rank 0's parameters
        for p in module.parameters():
            p.data.normal_()
    local = GLOBAL_BATCH // dp
    rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
    per_row = len(y) // len(x)  # target rows per input row (flat_lm: its sequence)
    xs = x[rows].numpy()
    ys = y[rows.start * per_row:rows.stop * per_row].numpy()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_optimizer(opt_name))
    assert isinstance(trainer, raf_dist.Trainer) and trainer.num_stages >= pp
    loaded = 0
    if "--load" in flags:
        trainer.load_checkpoint(flags["--load"])
        loaded = trainer.step_count
    losses = [trainer.step(xs, ys) for _ in range(steps - 1)]
    dist.reset_comm_counters()  # the last step's traffic, per group
    losses.append(trainer.step(xs, ys))
    if flags.get("--check-extraction") == "1":
        check_extraction(trainer, module, x[rows], mesh, dp, pp, tp, zero, microbatches,
                         schedule, opt_name)

    assert_like_one_process(trainer, losses, name, opt_name, GLOBAL_BATCH, loaded, TOL)

    if flags.get("--checkpointing") == "selective":  # what each stage's backward recomputes
        for rows, stage_set in trainer.executor._stage_sets.items():
            for s, stage in sorted(stage_set.stages.items()):
                count = stage.functions.mod["backward"].script().count("_re: ")
                print(f"selective: stage {s} recomputes {count} values ({rows} rows)")
                total = total + count if s != min(stage_set.stages) else count
            assert total > 0, "no stage of this rank recomputed anything"

    stats = trainer.stats()["pipeline"]
    if "--budget" in flags:
        modelled = stats["modelled_activation_bytes"]
        print(f"budget: rank {comm.rank} stages {stats['stages']} recompute "
              f"{stats['recompute']} modelled {modelled / 2**20:.3f} MB")
        assert modelled <= float(flags["--budget"]) * 2**20, (modelled, stats["recompute"])
    # the saved values and boundary messages (every receive posted first, each message kept
    # to the step's end) the rank held at once, as runtime/stage_budget.py walks its actions
    assert stats["peak_held_bytes"] == stats["modelled_held_bytes"], stats
    for stage, peak in stats["peak_saved_microbatches"].items():
        expected = {"1f1b": min(pp - stage, microbatches), "gpipe": microbatches}.get(schedule)
        assert peak == expected if expected else 1 <= peak <= microbatches, (stage, peak, stats)
    if "--save" in flags:
        trainer.save_checkpoint(flags["--save"])
    if comm.rank == 0:
        print(trainer.plan.describe())
    print(f"rank {comm.rank}: PP OK stages {stats['stages']} peak "
          f"{stats['peak_saved_microbatches']}")


def check_extraction(trainer, module, x, mesh, dp, pp, tp, zero, microbatches, schedule,
                     opt_name):
    """The collectives raf_dist.proxies extracts from this mesh's compiled step (one process,
    no MPI) are the ones the last step ran: per tp and dp group, calls and bus bytes by kind
    as the native counters recorded them; the pipeline messages' bytes as the transport
    sent them. (The pipeline's own control collectives on the pp group and the world are
    not in the extraction; they are not compared.)"""
    from raf_dist.proxies import MeshSpec, extract

    model = raf_dist.frontend.from_pytorch(module, (x,))
    workload = extract(model, MeshSpec(dp=dp, tp=tp, pp=pp, zero=zero,
                                       microbatches=microbatches, schedule=schedule),
                       optimizer=raf_optimizer(opt_name))
    extracted = workload.bus_bytes(mesh.pp_rank)
    for axis, group in (("tp", mesh.tp_group), ("dp", mesh.dp_group)):
        recorded = {k: v for k, v in dist.comm_counters(group=group).items() if v["calls"]}
        want = extracted.get(axis, {})
        assert {k: v["calls"] for k, v in recorded.items()} == {
            k: v["calls"] for k, v in want.items()}, (axis, recorded, want)
        for kind, v in want.items():
            assert abs(recorded[kind]["bus_bytes"] - v["bus_bytes"]) < 0.5, (axis, kind,
                                                                            recorded, want)
    sent = sum(e.bytes for e in workload.programs[mesh.pp_rank] if e.kind == "send")
    assert trainer.stats()["comm_bytes_last_step"]["send"] == sent, (
        trainer.stats()["comm_bytes_last_step"], sent)
    print(f"rank {dist.get_communicator().rank}: extraction equals the step's collectives "
          f"{ {a: {k: v['calls'] for k, v in d.items()} for a, d in extracted.items()} }")


if __name__ == "__main__":
    main()

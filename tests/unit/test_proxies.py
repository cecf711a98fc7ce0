"""raf_dist.proxies without MPI: the extraction of a step's collectives (proxies/extract.py)
against what the step must send, the presets' message sizes against the C++ proxies', and the
simulator's alpha-beta arithmetic. The extraction equal to a real 8-rank step's recorded
collectives is tests/distributed/test_pipeline.py's dp2 x pp2 x tp2 case; the replay under
mpirun is tests/distributed/test_proxies.py."""
import dataclasses
import json
import sys
import types

import numpy as np
import pytest
import tvm

import raf_dist
from raf_dist.proxies import (CLUSTERS, Cluster, Event, Link, MeshSpec, Workload, extract,
                              load_cluster, simulate)
from raf_dist.proxies import models as proxy_models
from raf_dist.proxies.__main__ import build_workload, main
from raf_dist.proxies.presets import cosmoflow_workload

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from models import make  # noqa: E402


@pytest.fixture(scope="module")
def transformer():
    module, x, _ = make("transformer", 8)
    return raf_dist.frontend.from_pytorch(module, (x,))


def _param_bytes(model):
    return sum(int(np.prod(s)) * 4 for s, _ in model.param_specs())


def test_dp_extraction_reduces_every_gradient_once_and_waits_for_it(transformer):
    w = extract(transformer, MeshSpec(dp=2))
    events = w.programs[0]
    grads = [e for e in events if e.kind == "allreduce" and e.bytes > 4]
    # every gradient in one bucket, each bucket padded to a multiple of 16 elements
    padding = sum(e.bytes for e in grads) - _param_bytes(transformer)
    assert 0 <= padding < 16 * 4 * len(grads)
    assert all(e.axis == "dp" and e.handle >= 0 for e in grads)  # overlapped: started
    for e in grads:  # ... and waited later, once
        starts = events.index(e)
        assert [x.kind for x in events[starts:] if x.handle == e.handle] == ["allreduce", "wait"]
    assert events[-1].kind == "allreduce" and events[-1].bytes == 4  # the loss
    blocking = extract(transformer, MeshSpec(dp=2, overlap=False)).programs[0]
    assert all(e.handle == -1 for e in blocking) and not any(e.kind == "wait" for e in blocking)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_extraction_shards_every_gradient_and_gathers_every_parameter(transformer, zero):
    totals = extract(transformer, MeshSpec(dp=2, zero=zero)).totals()
    # ZeRO's buffers are the flat shards padded to a multiple of the ranks (even here)
    assert totals["reduce_scatter"]["bytes"] == _param_bytes(transformer)
    if zero < 3:  # the updated shards gathered once
        assert totals["allgather"]["bytes"] == _param_bytes(transformer)
    else:  # gathered for the forward, and those the backward reads again for it
        assert _param_bytes(transformer) < totals["allgather"]["bytes"] < 2 * _param_bytes(
            transformer)
    # a bucket's reduce-scatter is one runtime call per gradient (Event.parts): every
    # parameter tensor once, at its size, so the simulator charges each call's latency
    events = extract(transformer, MeshSpec(dp=2, zero=zero)).programs[0]
    parts = sorted(p for e in events if e.kind == "reduce_scatter" for p in (e.parts or [e.bytes]))
    assert parts == sorted(int(np.prod(s)) * 4 for s, _ in transformer.param_specs())
    assert all(e.calls == len(e.parts) > 1 for e in events if e.kind == "allgather")


def test_compute_is_the_models_flops_split_by_tp_and_pipeline(transformer):
    from raf_dist.runtime.metrics import function_flops
    from raf_dist.training import build_train_step

    mod, _ = build_train_step(transformer, "cross_entropy", raf_dist.optim.AdamW(lr=1e-3))
    flops = function_flops(mod["train_step"])
    assert extract(transformer, MeshSpec()).flops(0) == flops
    gpt = proxy_models.gpt(2, 64, 4, 16, 96, 4)
    whole = extract(gpt, MeshSpec()).flops(0)
    assert extract(gpt, MeshSpec(tp=2)).flops(0) == pytest.approx(whole / 2, rel=0.02)
    staged = extract(gpt, MeshSpec(pp=2, microbatches=2))
    assert staged.flops(0) + staged.flops(1) == pytest.approx(whole, rel=0.02)


def test_operator_calls_are_counted_per_rank_and_charged_per_call(transformer):
    """Every operator call of the step is in one compute event (a dp rank makes all of them,
    whatever the batch split), and the cost model charges op_overhead_us for each: a small
    model's step is its calls (bench/step_time.py's GPT on an H200 is host-bound)."""
    from tvm import relax

    from raf_dist.training import build_train_step

    mod, _ = build_train_step(transformer, "cross_entropy", raf_dist.optim.AdamW(lr=1e-3))
    calls = sum(1 for block in mod["train_step"].body.blocks for b in block.bindings
                if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op))
    from raf_dist.proxies.extract import function_events

    assert sum(e.ops for e in function_events(mod["train_step"])) == calls
    one = extract(transformer, MeshSpec())  # through the step's passes, which add calls
    assert sum(e.ops for e in one.programs[0]) >= calls
    dp = extract(transformer, MeshSpec(dp=2))
    assert sum(e.ops for e in dp.programs[0] if e.kind == "compute") >= calls
    slow_host = Cluster("t", 8, 1e6, 1e6, Link(0.0, 1e6), Link(0.0, 1e6), op_overhead_us=10.0)
    ops = sum(e.ops for e in one.programs[0])
    assert simulate(one, slow_host).iteration_s == pytest.approx(ops * 10e-6, rel=1e-3)
    # an old cluster file without the key: no host term
    old = {k: v for k, v in slow_host.to_dict().items() if k != "op_overhead_us"}
    assert Cluster.from_dict(old).op_overhead_us == 0.0


def test_compute_events_name_the_matmuls_the_blas_runs(transformer):
    """Every float32 matmul of a step is in its compute event's ``gemms`` under the shapes and
    transpose flags DispatchToBLAS hands raf_dist.blas.matmul (the shapes calibrate measures:
    Cluster.gemm_efficiency), and their FLOPs are the event's."""
    from collections import Counter

    from tvm import relax

    from raf_dist.passes.dispatch_blas import BLAS_MATMUL, DispatchToBLAS
    from raf_dist.proxies.extract import function_events
    from raf_dist.proxies.workload import gemm_flops, gemm_key
    from raf_dist.training import build_train_step

    mod, _ = build_train_step(transformer, "cross_entropy", raf_dist.optim.AdamW(lr=1e-3))
    events = [e for e in function_events(mod["train_step"]) if e.kind == "compute"]
    extracted = Counter()
    from raf_dist.ir.attention import is_attention
    from raf_dist.ir.ops import ATTENTION_GRAD
    from raf_dist.runtime.metrics import call_flops

    for e in events:
        extracted.update(e.gemms)
        assert sum(n * gemm_flops(k) for k, n in e.gemms.items()) <= e.flops
    # the rest of the events' FLOPs are the attention op's (its host kernel, no BLAS GEMM)
    attention = sum(call_flops(b.value) for block in mod["train_step"].body.blocks
                    for b in block.bindings
                    if is_attention(b.value) or (isinstance(b.value, relax.Call) and getattr(
                        b.value.op, "name", "") == ATTENTION_GRAD))
    assert attention > 0
    assert sum(e.flops for e in events) - sum(
        n * gemm_flops(k) for e in events for k, n in e.gemms.items()) == attention
    dispatched = Counter()
    for block in DispatchToBLAS()(mod)["train_step"].body.blocks:
        for b in block.bindings:
            v = b.value
            if (isinstance(v, relax.Call) and v.op.name == "relax.call_dps_packed"
                    and v.args[0].global_symbol == BLAS_MATMUL):
                a, bb, ta, tb = v.args[1].fields
                dispatched[gemm_key(a.ty.shape.values, bb.ty.shape.values, ta.value,
                                    tb.value)] += 1
    assert extracted == dispatched and len(extracted) > 3
    assert any(k.endswith(("01", "10")) for k in extracted)  # autodiff's transposes, folded
    # 16-bit matmuls are not the shapes measured in float32: they run at the matmul rate
    half = Workload("t", 1, 1, 1, 0, 1, "1f1b", [events]).in_16_bit()
    assert all(not e.gemms for e in half.programs[0])


@pytest.mark.parametrize("a,b,ta,tb", [
    ((256, 128), (512, 128), 0, 1), ((128, 256), (128, 64), 1, 0),
    ((16, 64, 32), (16, 32, 64), 0, 0), ((2, 1, 8, 4), (3, 4, 5), 0, 0),
    ((16, 64, 128), (128, 512), 0, 0)])
def test_gemm_key_flops_and_bytes_follow_numpy(a, b, ta, tb):
    from raf_dist.proxies.workload import gemm_bytes, gemm_flops, gemm_key, parse_gemm_key

    key = gemm_key(a, b, ta, tb)
    assert parse_gemm_key(key) == (list(a), list(b), bool(ta), bool(tb))
    lhs, rhs = np.zeros(a, np.float32), np.zeros(b, np.float32)
    lhs = np.swapaxes(lhs, -1, -2) if ta else lhs
    rhs = np.swapaxes(rhs, -1, -2) if tb else rhs
    out = np.matmul(lhs, rhs)
    assert gemm_flops(key) == 2 * out.size * lhs.shape[-1]
    assert gemm_bytes(key) == lhs.nbytes + rhs.nbytes + out.nbytes


@pytest.mark.parametrize("key", ["256x128,512x128", "256x128,512x128,2", "256,512x128,00",
                                 "2x4x8,3x8x5,00", "axb,512x128,00"])
def test_gemm_key_that_is_no_matmul_is_refused_by_name(key):
    from raf_dist.proxies.workload import parse_gemm_key

    with pytest.raises(ValueError, match="is not a matmul shape"):
        parse_gemm_key(key)


def test_measured_matmul_shapes_run_at_their_own_rate_and_traffic():
    """A shape in Cluster.gemm_efficiency costs its FLOPs at matmul_tflops x its efficiency
    plus its operands' and result's bytes at memory_GBps; any other matmul FLOPs at
    matmul_tflops (the presets: no table)."""
    from raf_dist.proxies.simulate import compute_seconds
    from raf_dist.proxies.workload import gemm_bytes, gemm_flops

    key, other = "256x128,512x128,01", "64x64,64x64,00"
    e = Event("compute", flops=3 * gemm_flops(key) + gemm_flops(other), mem_bytes=1000, ops=7,
              gemms={key: 3, other: 1})
    base = Cluster("t", 1, 0.1, 20.0, Link(0.0, 1e6), Link(0.0, 1e6), op_overhead_us=2.0)
    flat = e.flops / 0.1e12 + 1000 / 20e9 + 7 * 2e-6
    assert compute_seconds(e, base) == pytest.approx(flat)
    table = dataclasses.replace(base, gemm_efficiency={key: 0.5})
    assert compute_seconds(e, table) == pytest.approx(
        3 * (gemm_flops(key) / 0.05e12 + gemm_bytes(key) / 20e9) + gemm_flops(other) / 0.1e12
        + 1000 / 20e9 + 7 * 2e-6)
    # the table travels with the cluster's JSON, and the workload's with its events
    assert Cluster.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    assert hash(table) == hash(base)  # a cluster stays hashable (the table is not hashed)
    w = Workload("t", 1, 1, 1, 0, 1, "1f1b", [[e]])
    assert Workload.from_json(w.to_json()).programs[0][0].gemms == {key: 3, other: 1}


def test_pipeline_programs_pair_every_message(transformer):
    w = extract(transformer, MeshSpec(pp=2, microbatches=4))
    boundary = 8 // 4 * 4 * 32 * 4  # rows per microbatch x 4 x hidden x float32 (the
    # transformer's block output: tests/models.py)
    sends = [(e.tag, e.bytes) for e in w.programs[0] if e.kind == "send"]
    recvs = [(e.tag, e.bytes) for e in w.programs[1] if e.kind == "recv"]
    assert len(sends) == 4 and sorted(sends) == sorted(recvs)
    assert {b for _, b in sends} == {boundary}
    back = sorted((e.tag, e.bytes) for e in w.programs[1] if e.kind == "send")
    assert back == sorted((e.tag, e.bytes) for e in w.programs[0] if e.kind == "recv")
    result = simulate(w, CLUSTERS["dgx-a100"])  # every receive meets its send
    assert result.iteration_s > 0 and 0 < result.bubble < 1


def test_per_stage_recomputation_extracts_each_stage_at_its_level(transformer):
    """MeshSpec.stage_recompute (what activation_memory_budget_mb chooses per stage): each
    pp rank runs its stage's events of the uniform level it was given, F and B alike."""
    def events(w, r):
        return [(e.kind, e.flops, e.bytes, e.ops) for e in w.programs[r]]

    mixed = extract(transformer, MeshSpec(pp=2, microbatches=2, stage_recompute=("full", "none")))
    full = extract(transformer, MeshSpec(pp=2, microbatches=2, recompute="full"))
    none = extract(transformer, MeshSpec(pp=2, microbatches=2))
    assert events(mixed, 0) == events(full, 0) and events(mixed, 1) == events(none, 1)
    assert events(full, 0) != events(none, 0)  # the levels differ where they apply
    with pytest.raises(ValueError, match="2 pipeline stages"):
        extract(transformer, MeshSpec(pp=2, microbatches=2, stage_recompute=("full",) * 3))


def test_gpt2_preset_sends_the_cpp_proxys_messages():
    args = _args("gpt2", layers=8, stages=4, microbatches=2)
    w, spcl = build_workload(args, 8)
    floats = {e.bytes // 4 for e in w.programs[1] if e.kind in ("send", "recv")}
    assert floats == {632 * 1280} == {spcl[0][1]}
    layer = spcl[1][1]  # 19,677,440: one bucket per layer, as the C++ proxy reduces
    middle = [e.bytes // 4 for e in w.programs[1] if e.kind == "allreduce" and e.bytes > 4]
    assert set(middle) == {layer} and len(middle) >= 2  # a middle stage: layers only


def test_gpt3_preset_tp_and_pipeline_messages():
    args = _args("gpt3", layers=2, stages=2, microbatches=2)
    w, spcl = build_workload(args, 16)  # dp 2 x tp 4 x pp 2
    assert (w.dp, w.tp, w.pp) == (2, 4, 2)
    activation = 2048 * 12288
    last = [e for e in w.programs[1] if e.kind == "allreduce" and e.axis == "tp"]
    # one layer per stage: 2 allreduces forward (g after attention and MLP), 2 backward (f
    # before them), per microbatch: the C++ proxy's count; the last stage adds the
    # vocabulary-parallel head's input gradient (f before the head) per microbatch
    assert sum(e.bytes // 4 == activation for e in last) == 4 * 2 + 2
    p2p = {e.bytes // 4 for e in w.programs[0] if e.kind in ("send", "recv")}
    assert p2p == {activation}
    dp = [e.bytes // 4 for e in w.programs[1] if e.axis == "dp" and e.bytes > 4]
    assert sum(dp) >= 12 * 12288 ** 2 // 4  # a layer's 12 h^2 over tp 4, plus the head


def test_dlrm_preset_exchanges_rows_by_alltoall():
    w, spcl = build_workload(_args("dlrm"), 4)
    alltoall = [e for e in w.programs[0] if e.kind == "alltoall"]
    assert all(e.axis == "dp" for e in alltoall)
    # per table: this rank's 512 ids (int32) to the owner, the owner's rows back (rank 0 owns
    # one table: 4 ranks x 512 x 128 floats), in backward every rank's 512 x 128 row
    # gradients to the owner: what this rank sends is the C++ proxy's 262,144 floats forward
    # and again backward, plus the ids
    assert sum(e.bytes for e in alltoall) == 2 * 262_144 * 4 + 4 * 512 * 4
    grads = [e.bytes // 4 for e in w.programs[0] if e.kind == "allreduce" and e.bytes > 4]
    # the MLPs' gradients in one bucket (padded to 16 elements); the tables' are not reduced
    assert grads == [-(-(728_065 + 49_536) // 16) * 16]
    # the MLPs under ZeRO-2 beside the tables: reduce-scattered and gathered, the same
    # exchanges; the tables' gradients still travel by the exchange alone
    w, _ = build_workload(_args("dlrm", zero=2), 4)
    kinds = {e.kind for e in w.programs[0]}
    assert {"reduce_scatter", "allgather", "alltoall"} <= kinds, kinds
    scattered = sum(e.bytes for e in w.programs[0] if e.kind == "reduce_scatter")
    assert scattered == 4 * (728_065 + 49_536), scattered  # whole tensors, dense layers only
    # dp 2 x tp 2: the MLPs split over tp (their partial sums allreduced over tp), the tables
    # whole on every tp rank and exchanged over dp only
    w, _ = build_workload(_args("dlrm", tp=2), 4)
    axes = {(e.kind, e.axis) for e in w.programs[0]}
    assert ("alltoall", "dp") in axes and ("alltoall", "tp") not in axes, axes
    assert any(axis == "tp" for _, axis in axes), axes


def test_simulated_collectives_follow_the_alpha_beta_model():
    cluster = Cluster("t", 4, 1.0, 1.0, Link(10.0, 1.0), Link(100.0, 0.1))
    S = 10**9

    def one(events, dp=4):
        return simulate(Workload("t", dp, 1, 1, 0, 1, "1f1b", [events]), cluster)

    assert one([Event("compute", flops=10**12)]).iteration_s == pytest.approx(1.0)
    blocking = one([Event("allreduce", bytes=S, axis="dp")]).iteration_s
    assert blocking == pytest.approx(2 * 3 * 10e-6 + 2 * 3 / 4 * 1.0)
    inter = one([Event("allreduce", bytes=S, axis="dp")], dp=8).iteration_s  # 8 > 4 per node
    assert inter == pytest.approx(2 * 7 * 100e-6 + 2 * 7 / 8 * 10.0)
    # a bucket of 3 tensors is 3 calls: 3 rings' latency, the bucket's bytes once
    bucket = one([Event("reduce_scatter", bytes=S, axis="dp", parts=[S // 2, S // 4, S // 4])])
    assert bucket.iteration_s == pytest.approx(3 * 3 * 10e-6 + 3 / 4 * 1.0)
    with pytest.raises(ValueError, match="must add up to its bytes"):
        Event("allgather", bytes=S, axis="dp", parts=[S // 2])
    # as 16-bit (Workload.in_16_bit): each tensor halved, the bucket their sum, and the
    # workload still valid through JSON (what every replay rank reads)
    w = Workload("t", 4, 1, 1, 2, 1, "1f1b",
                 [[Event("reduce_scatter", bytes=18, axis="dp", parts=[6, 12])]]).in_16_bit()
    e = Workload.from_json(w.to_json()).programs[0][0]
    assert (e.bytes, e.parts, e.calls) == (9, [3, 6], 2)
    # started before 3 s of compute, waited after it: hidden
    hidden = one([Event("allreduce", bytes=S, axis="dp", handle=0),
                  Event("compute", flops=3 * 10**12), Event("wait", handle=0)])
    assert hidden.iteration_s == pytest.approx(3.0)
    assert hidden.per_rank[0]["exposed_s"] == 0
    orphan = Workload("t", 1, 1, 2, 0, 1, "1f1b",
                      [[Event("recv", bytes=4, axis="pp", peer=1, tag=0)], []])
    with pytest.raises(ValueError, match="wait for messages no rank sends"):
        simulate(orphan, cluster)


def test_a_meeting_after_compute_costs_a_share_of_it_up_to_a_cap():
    """Ranks sharing cores (Cluster.meeting_ratio / meeting_cap_us): a collective or a
    pipeline message met after W seconds of compute costs min(ratio x W, cap) beyond its
    alpha-beta time (ratio x W without a cap); the compute is counted from the rank's
    previous meeting; a group of one rank meets no one; a dedicated-device cluster (0, 0) is
    the plain model."""
    shared = Cluster("t", 4, 1.0, 1.0, Link(0.0, 1e9), Link(0.0, 1e9), meeting_ratio=0.5,
                     meeting_cap_us=3e5)  # cap 0.3 s

    def one(events, dp=4, pp=1, cluster=shared):
        programs = events if pp > 1 else [events]
        return simulate(Workload("t", dp, 1, pp, 0, 1, "1f1b", programs), cluster)

    def compute(seconds):
        return Event("compute", flops=int(seconds * 10**12))

    reduce = Event("allreduce", bytes=4, axis="dp")
    assert one([compute(0.2), reduce]).iteration_s == pytest.approx(0.2 + 0.1)
    assert one([compute(2.0), reduce]).iteration_s == pytest.approx(2.0 + 0.3)  # capped
    # 1 s, a meeting, 0.4 s, a meeting: each after its own compute
    twice = one([compute(1.0), reduce, compute(0.4), reduce])
    assert twice.iteration_s == pytest.approx(1.0 + 0.3 + 0.4 + 0.2)
    assert twice.per_rank[0]["meeting_s"] == pytest.approx(0.5)
    assert one([compute(1.0), reduce], dp=1).iteration_s == pytest.approx(1.0)
    plain = dataclasses.replace(shared, meeting_ratio=0.0, meeting_cap_us=0.0)
    assert one([compute(1.0), reduce], cluster=plain).iteration_s == pytest.approx(1.0)
    # a pipeline message arrives late by the sender's share; the receive is the receiver's
    # meeting: its compute before it is not charged to its next collective
    piped = one([[compute(0.2), Event("send", bytes=4, axis="pp", peer=1, tag=0)],
                 [compute(0.1), Event("recv", bytes=4, axis="pp", peer=0, tag=0),
                  compute(0.2), Event("allreduce", bytes=4, axis="pp")]], dp=1, pp=2)
    assert piped.per_rank[1]["iteration_s"] == pytest.approx(0.2 + 0.1 + 0.2 + 0.1)
    # a started collective's lateness is on the communication stream: compute hides it
    hidden = one([compute(0.4), Event("allreduce", bytes=4, axis="dp", handle=0),
                  compute(0.5), Event("wait", handle=0)])
    assert hidden.iteration_s == pytest.approx(0.9)  # its 0.2 s late, under 0.5 s of compute
    assert hidden.per_rank[0]["meeting_s"] == pytest.approx(0.2)
    assert CLUSTERS["dgx-h100"].meeting_ratio == 0.0  # dedicated devices
    # no cap (calibrated with more ranks than cores): the lateness grows with the compute
    uncapped = dataclasses.replace(shared, meeting_cap_us=0.0)
    assert one([compute(2.0), reduce], cluster=uncapped).iteration_s == pytest.approx(3.0)
    # a fixed host time per collective of more than one rank, none per pipeline message
    fixed = dataclasses.replace(shared, meeting_us=5e4)  # 0.05 s
    assert one([compute(0.2), reduce], cluster=fixed).iteration_s == pytest.approx(0.35)
    assert one([compute(1.0), reduce], dp=1, cluster=fixed).iteration_s == pytest.approx(1.0)
    piped_fixed = one([[compute(0.2), Event("send", bytes=4, axis="pp", peer=1, tag=0)],
                       [Event("recv", bytes=4, axis="pp", peer=0, tag=0)]], dp=1, pp=2,
                      cluster=fixed)
    assert piped_fixed.iteration_s == pytest.approx(0.2 + 0.1)


def test_a_meeting_costs_what_its_group_was_measured_to_cost():
    """Cluster.meeting_groups: a collective's lateness ratio and cap are those calibrated for
    its group (SIZExSTRIDE: tp neighbours, dp ranks tp apart), the whole node's
    (meeting_ratio / meeting_cap_us) for a group not measured, for a pipeline message and
    where the table was measured with another number of ranks; the calibration's groups are
    the ones the simulator names."""
    from raf_dist.proxies.calibrate import group_color, meeting_group_shapes
    from raf_dist.proxies.simulate import meeting_group

    four = Cluster("t", 4, 1.0, 1.0, Link(0.0, 1e9), Link(0.0, 1e9), meeting_ratio=0.5,
                   meeting_groups={"2x1": [0.1, 0.0], "2x2": [0.2, 0.0]})
    eight = dataclasses.replace(four, gpus_per_node=8,
                                meeting_groups={"2x1": [0.1, 0.0], "2x4": [0.3, 5e4]})

    def compute(seconds):
        return Event("compute", flops=int(seconds * 10**12))

    tp, dp = Event("allreduce", bytes=4, axis="tp"), Event("allreduce", bytes=4, axis="dp")
    step = [compute(1.0), tp, compute(1.0), dp]
    # dp 2 x tp 2 on 4 ranks: tp pairs of neighbours (0.1), dp pairs 2 apart (0.2)
    small = Workload("t", 2, 2, 1, 0, 1, "1f1b", [step])
    assert simulate(small, four).iteration_s == pytest.approx(1.0 + 0.1 + 1.0 + 0.2)
    assert simulate(small, dataclasses.replace(four, meeting_groups={})).iteration_s \
        == pytest.approx(3.0)
    # the same mesh against a table of 8 ranks (its groups sit on other cores): the node's
    assert meeting_group(small, tp, eight) == ""
    assert simulate(small, eight).iteration_s == pytest.approx(3.0)
    # dp 4 x tp 2 on 8 ranks: dp groups of 4 ranks 2 apart, not measured: the node's 0.5
    wide = Workload("t", 4, 2, 1, 0, 1, "1f1b", [step])
    assert meeting_group(wide, dp, eight) == "4x2" and meeting_group(wide, tp, eight) == "2x1"
    assert simulate(wide, eight).iteration_s == pytest.approx(1.0 + 0.1 + 1.0 + 0.5)
    # a pipeline message between stages of dp 2 x tp 2 ranks (2 ranks 4 apart, "2x4" measured
    # for a collective's pairs): the node's 0.5
    piped = simulate(Workload("t", 2, 2, 2, 0, 1, "1f1b", [
        [compute(1.0), Event("send", bytes=4, axis="pp", peer=1, tag=0)],
        [Event("recv", bytes=4, axis="pp", peer=0, tag=0)]]), eight)
    assert piped.iteration_s == pytest.approx(1.0 + 0.5)
    # the pp axis's collective on that mesh (a tied embedding's): 2 ranks 4 apart, capped
    pp_reduce = [compute(1.0), Event("allreduce", bytes=4, axis="pp")]
    assert simulate(Workload("t", 2, 2, 2, 0, 1, "1f1b", [pp_reduce, pp_reduce]),
                    eight).iteration_s == pytest.approx(1.0 + 0.05)
    # the calibration's groups: for every shape of 8 ranks, each rank's group (group_color)
    # holds the ranks the simulator's name for it says
    assert meeting_group_shapes(2) == [(2, 1)]
    assert meeting_group_shapes(8) == [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4)]
    for size, stride in meeting_group_shapes(8):
        groups = {}
        for rank in range(8):
            groups.setdefault(group_color(rank, size, stride), []).append(rank)
        assert all(len(g) == size and all(b - a == stride for a, b in zip(g, g[1:]))
                   for g in groups.values()), (size, stride, groups)


def test_cosmoflow_description_and_clusters(tmp_path):
    w = cosmoflow_workload(2, 4)
    starts = {e.handle for e in w.programs[0] if e.kind == "allreduce"}
    assert len(starts) == 6 and starts == {e.handle for e in w.programs[0] if e.kind == "wait"}
    assert simulate(w, CLUSTERS["dgx-h100"]).iteration_s > 0
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CLUSTERS["dgx-a100"].to_dict()))
    assert load_cluster(str(path)) == CLUSTERS["dgx-a100"]
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="needs the keys"):
        load_cluster(str(path))
    with pytest.raises(ValueError, match="unknown cluster"):
        load_cluster("dgx-z100")


def test_mesh_spec_refuses_what_the_trainer_refuses():
    with pytest.raises(ValueError, match="needs dp > 1"):
        MeshSpec(zero=2)
    # the Trainer's own table (layout.refusals.REFUSALS), its messages
    with pytest.raises(ValueError, match="zero_opt_level=3 with pipeline_parallel_size=2"):
        MeshSpec(dp=2, pp=2, zero=3)
    with pytest.raises(ValueError, match="zero_opt_level=2 with pipeline_parallel_size=2"):
        MeshSpec(dp=2, pp=2, zero=2)
    MeshSpec(dp=2, pp=2, zero=1)  # the pipeline's update shards the optimizer state
    with pytest.raises(NotImplementedError, match="with pipeline_parallel_size=2 is not built"):
        MeshSpec(dp=2, pp=2, embedding_parallel="table")
    MeshSpec(dp=2, zero=3, embedding_parallel="table")  # the dense layers under ZeRO
    MeshSpec(dp=2, tp=2, embedding_parallel="table")  # the MLPs split, the tables whole
    with pytest.raises(ValueError, match="per pipeline stage"):
        MeshSpec(dp=2, stage_recompute=("full",))
    with pytest.raises(ValueError, match="per pipeline stage"):
        MeshSpec(pp=2, stage_recompute=("full", "some"))


def test_simulate_cli_prints_the_side_by_side_and_the_prediction(capsys):
    assert main(["gpt2", "--simulate", "--world", "8", "--layers", "8", "--stages", "4",
                 "--microbatches", "2", "--cluster", "dgx-a100"]) == 0
    out = capsys.readouterr().out
    assert "spcl:" in out and "808,960 floats  send over pp" in out
    assert "simulated on dgx-a100" in out
    with pytest.raises(SystemExit, match="do not split"):
        main(["gpt2", "--simulate", "--world", "6"])


def _args(workload, **kw):
    base = dict(workload=workload, layers=None, stages=None, microbatches=None, tp=None,
                dp=None, zero=0, schedule="1f1b", micro_batch=None, bucket_mb=None,
                embedding_parallel=None, recompute="none", vocab=None, precision="fp32")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_calibrate_measures_this_host_and_its_host_time_per_call(tmp_path):
    """``python -m raf_dist.proxies calibrate`` (one process: no link to measure) writes a
    cluster file the simulator loads, with the GEMM and copy rates and the host time per
    operator call measured (a tiny model's steps: microseconds per call, not zero)."""
    import subprocess

    out = tmp_path / "here.json"
    shapes = tmp_path / "shapes.json"
    keys = ["256x128,512x128,01", "16x64x32,16x32x64,00"]  # a step's: 2-D, and batched heads
    shapes.write_text(json.dumps(keys))
    subprocess.run([sys.executable, "-m", "raf_dist.proxies", "calibrate", "--calibration-out",
                    str(out), "--gemm-shapes", str(shapes)], check=True, timeout=300,
                   capture_output=True)
    cluster = load_cluster(str(out))
    assert cluster.matmul_tflops > 0 and cluster.memory_GBps > 0
    assert 0.05 < cluster.op_overhead_us < 1000
    assert cluster.meeting_ratio == cluster.meeting_cap_us == cluster.meeting_us == 0.0
    # each shape's rate against the 1024^3 matmul's: two timings (positive, finite, not one
    # made-up value for both; no tighter bound, as a test running beside it on these 2
    # cores swings either side of the ratio)
    assert sorted(cluster.gemm_efficiency) == sorted(keys)
    values = list(cluster.gemm_efficiency.values())
    assert all(0 < v < float("inf") for v in values) and values[0] != values[1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    refused = subprocess.run([sys.executable, "-m", "raf_dist.proxies", "calibrate",
                              "--calibration-out", str(out), "--gemm-shapes", str(bad)],
                             timeout=300, capture_output=True, text=True)
    assert refused.returncode != 0 and "expected a JSON list" in refused.stderr
    bad.write_text(json.dumps(["256x128,512x128,01", "256x128;512x128"]))  # refused up front
    refused = subprocess.run([sys.executable, "-m", "raf_dist.proxies", "calibrate",
                              "--calibration-out", str(out), "--gemm-shapes", str(bad)],
                             timeout=300, capture_output=True, text=True)
    assert refused.returncode != 0 and "'256x128;512x128' is not a matmul shape" in refused.stderr


def test_measure_again_in_one_process_reuses_what_it_built_and_keeps_the_config(
        monkeypatch, dist_config):
    """``calibrate.measure`` called again in one process (bench/plan_validation.py measures
    the host between its Trainers' steps, every round): it measures again but builds nothing
    new (the tiny model's Trainer is kept in ``_BUILT``), and it builds that Trainer under
    its own parallelism whatever the user's config asks, leaving the config as it found it
    (num_microbatches too). Built under a data-parallel config the local Trainer was refused
    before (``Trainer(local=True)`` asks for no parallelism)."""
    from mpi4py import MPI

    from raf_dist.proxies import calibrate

    monkeypatch.setattr(calibrate, "WINDOW_S", 0.05)
    monkeypatch.setattr(calibrate, "_BUILT", {})
    asked = {"enable_data_parallel": True, "zero_opt_level": 2, "num_microbatches": 4}
    dist_config.update(asked)
    first = calibrate.measure(MPI.COMM_SELF)
    built = dict(calibrate._BUILT)
    second = calibrate.measure(MPI.COMM_SELF)
    assert list(built) == ["local"]
    assert calibrate._BUILT.keys() == built.keys()
    assert all(calibrate._BUILT[k] is v for k, v in built.items())
    assert {k: getattr(dist_config, k) for k in asked} == asked
    for cluster in (first, second):
        assert cluster.matmul_tflops > 0 and cluster.memory_GBps > 0
        assert 0.05 < cluster.op_overhead_us < 1000


def test_calibration_rates_are_taken_over_one_window_every_rank_starts_together():
    """calibrate's rates: each rank counts its calls over a window that begins when the last
    rank reaches the barrier (so every rank's work overlaps every other's), the first call
    (set-up) left out. Here: a call of 20 ms, a 0.3 s window -> at most 50 calls per second
    (one that counted the set-up call would give ~53; a window begun before the others
    arrived, 0.2 s earlier, ~30)."""
    import time

    from raf_dist.proxies.calibrate import window_rate

    events = []

    class Comm:
        def Barrier(self):  # the other ranks arrive 0.2 s after this one
            events.append("barrier")
            time.sleep(0.2)

    def call():
        events.append("call")
        time.sleep(0.02)

    rate = window_rate(Comm(), call, 0.3)
    assert events[:2] == ["call", "barrier"]  # the set-up call, then the common start
    assert 40 < rate <= 1 / 0.02  # a sleep overshoots by well under 5 ms


@pytest.mark.parametrize("masks, others, floating", [
    ([[0, 1]] * 4, [], True),  # 4 ranks left to the scheduler on 2 cores
    ([[0], [1], [0], [1]], [], False),  # bound round robin (--bind-to core): each keeps its share
    ([[0, 1]] * 2, [], False),  # a core per rank
    ([[0]], [[0], [1], [0], [1]], False),  # another host's ranks bound: still none floats
    ([[0, 1]] * 2, [[0, 1]] * 3, True),  # another host's float: every rank answers the same
])
def test_calibrate_tells_ranks_floating_on_shared_cores_from_bound_ones(masks, others, floating):
    """The meeting cap is dropped only where a host's ranks outnumber their cores and the
    scheduler places them (proxies/calibrate.py); every rank decides from the same gathered
    list, whichever host it is on (the answer sets how many collectives follow)."""
    import socket

    from raf_dist.proxies.calibrate import ranks_float_on_shared_cores

    class Comm:
        def allgather(self, mine):
            return ([(socket.gethostname(), m) for m in masks]
                    + [("another-host", m) for m in others])

    assert ranks_float_on_shared_cores(Comm()) is floating

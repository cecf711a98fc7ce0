"""Pipeline schedules (gpipe, 1f1b, interleaved_1f1b): validity, no deadlock, bubble, memory."""
import pytest

from raf_dist.training import pipeline_schedule as ps
from raf_dist.training import pipeline_simulation as sim
from raf_dist.training.pipeline_schedule import Action

SIMPLE = [
    (schedule, P, M)
    for schedule in ("gpipe", "1f1b")
    for P in (1, 2, 4)
    for M in (1, 2, 3, 4, 8)
]
INTERLEAVED = [(P, v, M) for P in (2, 4) for v in (2, 3) for M in (P, 2 * P)]


@pytest.mark.parametrize("schedule,P,M", SIMPLE)
def test_simple_schedules_valid_and_no_deadlock(schedule, P, M):
    actions = ps.rank_actions(schedule, P, M)
    assert len(actions) == P
    ps.check_actions(actions, ps.num_stages(schedule, P), M)
    assert all(seq[-1] == Action("UPDATE", -1, -1) for seq in actions)
    timeline = sim.simulate(actions, comm_cost=0.5)
    assert len(timeline) == 2 * P * M


@pytest.mark.parametrize("P,v,M", INTERLEAVED)
def test_interleaved_valid_and_no_deadlock(P, v, M):
    actions = ps.rank_actions("interleaved_1f1b", P, M, v)
    S = ps.num_stages("interleaved_1f1b", P, v)
    assert S == P * v
    ps.check_actions(actions, S, M)
    for comm in (0.0, 0.5):
        assert len(sim.simulate(actions, comm_cost=comm)) == 2 * S * M


@pytest.mark.parametrize("P", (1, 2, 4))
@pytest.mark.parametrize("M", (1, 2, 3, 4, 8))
def test_peak_in_flight(P, M):
    one_f_one_b = sim.peak_in_flight(ps.rank_actions("1f1b", P, M), P)
    assert one_f_one_b == {s: min(P - s, M) for s in range(P)}
    gpipe = sim.peak_in_flight(ps.rank_actions("gpipe", P, M), P)
    assert gpipe == {s: M for s in range(P)}


@pytest.mark.parametrize("schedule,P,M", SIMPLE)
def test_bubble_matches_ideal(schedule, P, M):
    timeline = sim.simulate(ps.rank_actions(schedule, P, M), 1.0, 2.0, 0.0)
    assert sim.bubble_fraction(timeline) == pytest.approx(sim.ideal_bubble(P, M), abs=1e-9)


@pytest.mark.parametrize("P,v,M", INTERLEAVED)
def test_interleaved_bubble_below_1f1b(P, v, M):
    inter = sim.bubble_fraction(sim.simulate(ps.rank_actions("interleaved_1f1b", P, M, v)))
    plain = sim.bubble_fraction(sim.simulate(ps.rank_actions("1f1b", P, M)))
    assert inter < plain
    assert inter == pytest.approx(sim.ideal_bubble(P, M, v), abs=1e-9)


def test_interleaved_p4_m8_v2_beats_1f1b():
    inter = sim.bubble_fraction(sim.simulate(ps.rank_actions("interleaved_1f1b", 4, 8, 2)))
    plain = sim.bubble_fraction(sim.simulate(ps.rank_actions("1f1b", 4, 8)))
    assert inter < plain


def test_1f1b_order_matches_megatron():
    compute = ps.compute_actions("1f1b", 4, 6)
    assert [str(a) for a in compute[0]] == [
        "F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F0.4", "B0.1", "F0.5", "B0.2",
        "B0.3", "B0.4", "B0.5",
    ]
    assert [str(a) for a in compute[3]] == [
        "F3.0", "B3.0", "F3.1", "B3.1", "F3.2", "B3.2", "F3.3", "B3.3", "F3.4", "B3.4",
        "F3.5", "B3.5",
    ]


def test_interleaved_order_rank0():
    # P=2, v=2, M=4: warmup on rank 0 = min(2 + 2, 8) = 4.
    compute = ps.compute_actions("interleaved_1f1b", 2, 4, 2)
    assert [str(a) for a in compute[0]] == [
        "F0.0", "F0.1", "F2.0", "F2.1",
        "F0.2", "B2.0", "F0.3", "B2.1", "F2.2", "B0.0", "F2.3", "B0.1",
        "B2.2", "B2.3", "B0.2", "B0.3",
    ]


def test_action_str():
    assert str(Action("F", 3, 1)) == "F3.1"
    assert str(Action("B", 0, 2)) == "B0.2"
    assert str(Action("SEND_F", 3, 1, 2)) == "SEND_F3.1->r2"
    assert str(Action("RECV_B", 2, 0, 1)) == "RECV_B2.0<-r1"
    assert str(Action("UPDATE", -1, -1)) == "UPDATE"


def test_communication_inserted():
    actions = ps.rank_actions("gpipe", 2, 1)
    assert [str(a) for a in actions[0]] == ["F0.0", "SEND_F0.0->r1", "RECV_B0.0<-r1", "B0.0",
                                            "UPDATE"]
    assert [str(a) for a in actions[1]] == ["RECV_F1.0<-r0", "F1.0", "B1.0", "SEND_B1.0->r0",
                                            "UPDATE"]
    # a single rank holds everything: no messages at all
    assert [str(a) for a in ps.rank_actions("1f1b", 1, 2)[0]] == [
        "F0.0", "B0.0", "F0.1", "B0.1", "UPDATE"
    ]


def test_deadlock_detected():
    # each rank waits for the other's gradient before sending its activation
    actions = [
        [Action("RECV_B", 0, 0, 1), Action("F", 0, 0), Action("SEND_F", 0, 0, 1),
         Action("B", 0, 0), Action("UPDATE", -1, -1)],
        [Action("RECV_F", 1, 0, 0), Action("F", 1, 0), Action("B", 1, 0),
         Action("SEND_B", 1, 0, 0), Action("UPDATE", -1, -1)],
    ]
    ps.check_actions(actions, 2, 1)  # structurally fine, only the order is wrong
    with pytest.raises(sim.DeadlockError, match="rank 0 blocked at RECV_B0.0<-r1"):
        sim.simulate(actions)


def test_deadlock_two_ranks_receive_first():
    actions = ps.rank_actions("1f1b", 2, 2)
    # rank 0 waits for B1.1's gradient before sending the activation of F0.1
    r0 = [a for a in actions[0] if str(a) != "RECV_B0.1<-r1"]
    r0.insert(r0.index(Action("F", 0, 1)), Action("RECV_B", 0, 1, 1))
    with pytest.raises(sim.DeadlockError):
        sim.simulate([r0, actions[1]])


def test_missing_backward_fails_check():
    actions = ps.rank_actions("1f1b", 2, 3)
    actions[0] = [a for a in actions[0] if a != Action("B", 0, 2)]
    with pytest.raises(ValueError, match="missing B0.2"):
        ps.check_actions(actions, 2, 3)


def test_unmatched_send_fails_check():
    actions = ps.rank_actions("gpipe", 2, 2)
    actions[1] = [a for a in actions[1] if a != Action("RECV_F", 1, 1, 0)]
    with pytest.raises(ValueError, match="RECV_F1.1"):
        ps.check_actions(actions, 2, 2)


def test_wrong_rank_and_duplicate_fail_check():
    actions = ps.compute_actions("gpipe", 2, 1)
    with pytest.raises(ValueError, match="lives on rank 0"):
        ps.check_actions([actions[0], actions[1] + [Action("F", 0, 0)]], 2, 1)
    with pytest.raises(ValueError, match="duplicate"):
        ps.check_actions([actions[0] + [Action("F", 0, 0)], actions[1]], 2, 1)


def test_draw_writes_png(tmp_path):
    timeline = sim.simulate(ps.rank_actions("interleaved_1f1b", 2, 4, 2))
    out = sim.draw(timeline, tmp_path / "pipe.png", title="interleaved")
    assert out == str(tmp_path / "pipe.png")
    data = (tmp_path / "pipe.png").read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_ideal_bubble():
    assert sim.ideal_bubble(4, 8) == pytest.approx(3 / 11)
    assert sim.ideal_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert sim.ideal_bubble(1, 5) == 0.0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ps.compute_actions("interleaved_1f1b", 4, 6, 2), "multiple of pp_size"),
        (lambda: ps.compute_actions("interleaved_1f1b", 4, 8, 1), ">= 2 stages per rank"),
        (lambda: ps.compute_actions("zero_bubble", 2, 4), "unknown pipeline schedule"),
        (lambda: ps.compute_actions("1f1b", 0, 4), "pp_size"),
        (lambda: ps.compute_actions("1f1b", 2, 0), "num_microbatches"),
        (lambda: ps.compute_actions("gpipe", 2, 4, 2), "1 stage per rank"),
        (lambda: ps.num_stages("interleaved_1f1b", 2), ">= 2 stages per rank"),
        (lambda: ps.rank_actions("1f1b", -1, 4), "pp_size"),
        (lambda: Action("X", 0, 0), "unknown action kind"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_stage_rank_loop_placement():
    assert [ps.stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_stage_budget_recomputes_the_stage_that_holds_most_first():
    """runtime/stage_budget.py's choice on a 1F1B rank holding stages 0 and 1 of 4 (its
    action list: stage 0 holds up to 4 microbatches, stage 1 up to 3): the stage whose step
    saves most moves first, one level at a time, until the modelled peak fits."""
    from raf_dist.runtime import stage_budget
    from raf_dist.training.pipeline_schedule import Action

    actions = [Action("F", 0, m) for m in range(4)] + [Action("F", 1, m) for m in range(3)]
    actions += [Action("B", 1, 0), Action("B", 0, 0)]
    timeline = stage_budget.held_timeline(actions, [0, 1])
    assert max(p[0][0] for p in timeline) == 4 and max(p[0][1] for p in timeline) == 3
    cost = {False: (100, 10), "selective": (40, 12), "full": (5, 10)}  # (saved, temps)
    chosen, peak = stage_budget.choose([0, 1], timeline, lambda s, lv: cost[lv], 10**9)
    assert chosen == {0: False, 1: False} and peak == 4 * 100 + 3 * 100 + 10
    chosen, peak = stage_budget.choose([0, 1], timeline, lambda s, lv: cost[lv], 600)
    assert chosen == {0: "selective", 1: False} and peak == 4 * 40 + 3 * 100 + 12
    chosen, peak = stage_budget.choose([0, 1], timeline, lambda s, lv: cost[lv], 300)
    assert chosen == {0: "selective", 1: "selective"} and peak == 4 * 40 + 3 * 40 + 12
    chosen, peak = stage_budget.choose([0, 1], timeline, lambda s, lv: cost[lv], 200)
    assert chosen == {0: "full", 1: "selective"} and peak == 4 * 5 + 3 * 40 + 12
    with pytest.raises(ValueError, match=r"smallest modelled activation memory is 4\.29e-05 MB"):
        stage_budget.choose([0, 1], timeline, lambda s, lv: cost[lv], 40)


def test_stage_budget_counts_the_boundary_messages_held():
    """held_timeline's boundary bytes on pp rank 1 of 2 under 1F1B with 2 microbatches
    (stages 0, 1 of 2: the rank holds stage 1, the last), and on rank 0 with a 16-bit
    message (the input gradient comes back float32 from the backward and leaves narrowed):
    every receive posted first, each message kept until the step ends."""
    from raf_dist.runtime import stage_budget
    from raf_dist.training import pipeline_schedule as ps

    actions = ps.rank_actions("1f1b", 2, 2, 1)
    last = stage_budget.held_timeline(actions[1], [1], stage_budget.Messages(
        [((4, 8), "float32")], {1: ((4, 8), "float32")}))
    message = 4 * 8 * 4
    assert last[0] == ({1: 0}, 2 * message)  # both activations' buffers posted
    # F(1, m) reads its activation; B(1, m) sends the input gradient, kept to the step's end
    assert last[-1][1] == 2 * message and max(b for _, b in last) == 2 * message
    first = stage_budget.held_timeline(actions[0], [0], stage_budget.Messages(
        [((4, 8), "bfloat16")], {}))
    half = 4 * 8 * 2
    assert first[0] == ({0: 0}, 2 * half)  # the two gradients' buffers posted
    # both forwards' activations sent and kept, the gradients read: 2 activations at the end
    assert first[-1][1] == 2 * half and max(b for _, b in first) == 4 * half
    saved = {0: 1000}
    # the peak: after F(0, 1), both microbatches' saved values and 4 messages held at once
    assert stage_budget.modelled_peak(first, saved, {0: 50}) == 2 * 1000 + 4 * half + 50
    assert stage_budget.modelled_peak(first, saved, {0: 50}, update_temps=10**6) == 10**6

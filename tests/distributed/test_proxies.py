"""The proxies replayed under mpirun (raf_dist.proxies; extraction in one process, tests/unit/
test_proxies.py): each preset runs its iterations through the native runtime and prints the
C++ proxy's message sizes beside the ones it replayed, which must be equal. Compute is slept
at dgx-a100 rates (cpu-here would sleep ~1 s per GPT-2 microbatch); the communication is this
machine's. 8 ranks here; the seeds' 32-rank runs are make test-slow."""
import re

import pytest

from mpi_launch import check_mpi

ARGS = ("--iters", 2, "--warmup", 1, "--cluster", "dgx-a100")


def _floats(out, who):
    """{floats: count} of the 'spcl:' or 'ours ppN:' lines."""
    found = {}
    for count, floats in re.findall(rf"{who}\s+(\d+) x\s+([\d,]+) floats", out):
        found[int(floats.replace(",", ""))] = found.get(int(floats.replace(",", "")), 0) + int(count)
    return found


def _replayed(out):
    assert re.search(r"measured iteration: median [\d.]+ ms", out), out
    assert "simulated on dgx-a100" in out


@pytest.mark.parametrize("ranks,layers,stages", [
    (8, 16, 8),
    pytest.param(32, 64, 8, marks=pytest.mark.slow),  # the seeds' `mpirun -n 32 ./gpt-2 64 8`
], ids=["8-ranks-8-stages", "32-ranks-64-layers-8-stages"])
def test_gpt2_proxy_replays_the_cpp_proxys_messages(ranks, layers, stages):
    out = check_mpi("proxy_run.py", ranks, "gpt2", "--layers", layers, "--stages", stages,
                    *ARGS, timeout=600)
    _replayed(out)
    spcl = _floats(out, "spcl:")
    # per microbatch one 632 x 1280 activation out and its gradient back, on the first and
    # on the last stage alike: the C++ proxy's count and size
    assert _floats(out, "ours pp0:")[632 * 1280] == spcl[632 * 1280] == 2 * 8
    assert _floats(out, f"ours pp{stages - 1}:")[632 * 1280] == spcl[632 * 1280]
    if ranks // stages > 1:  # dp replicas: the layers' allreduces, one bucket per layer
        assert 19_677_440 in _floats(out, f"ours pp{stages - 1}:")
    calls = re.search(r"send\s+([\d.]+)\s", out)
    assert calls and float(calls.group(1)) > 0


@pytest.mark.parametrize("ranks,zero", [(4, 0), (4, 2),
                                        pytest.param(32, 0, marks=pytest.mark.slow)])
def test_dlrm_proxy_replays_its_alltoalls(ranks, zero):
    out = check_mpi("proxy_run.py", ranks, "dlrm", "--zero", zero, *ARGS, timeout=600)
    _replayed(out)
    assert re.search(r"alltoall\s+[\d.]+\s+[\d.]+", out), out
    if ranks == 4:  # the seeds' configuration: 262,144 floats of rows on the owner
        assert 262_144 in _floats(out, "ours pp0:")
    if zero:  # the MLPs' bucket reduce-scattered and gathered as the step does: per tensor
        for kind in ("reduce_scatter", "allgather"):
            assert re.search(rf"^{kind}\s+1\.0\s+2\.97\s", out, re.M), (kind, out)


# (stop 71: 8 ranks in test-slow too, for time; replaying at 8 ranks: the gpt2 proxy's case)
@pytest.mark.parametrize("ranks", [pytest.param(8, marks=pytest.mark.slow),
                                   pytest.param(32, marks=pytest.mark.slow)])
def test_cosmoflow_proxy_replays_its_description(ranks):
    out = check_mpi("proxy_run.py", ranks, "cosmoflow", *ARGS, timeout=600)
    _replayed(out)
    for kind in ("allgather", "reduce_scatter", "allreduce"):
        assert re.search(rf"{kind}\s+[\d.]+\s+[\d.]+", out), (kind, out)


def test_proxy_refuses_a_world_it_cannot_split():
    from mpi_launch import run_mpi

    rc, out, _ = run_mpi("proxy_run.py", 3, "gpt2", *ARGS, timeout=300)
    assert rc != 0 and "do not split into tp 1 x pp 4" in out


@pytest.mark.slow
def test_calibrate_with_ranks_sharing_the_cores(tmp_path):
    """``mpirun -np 4 python -m raf_dist.proxies calibrate``: the link between the ranks, the
    lateness of a meeting (no cap once the ranks outnumber the cores) and the host time per
    collective (the tiny model's tensor-parallel step against its simulation) are measured
    and written where ``--cluster FILE`` reads them."""
    import json
    import os

    from raf_dist.proxies import load_cluster

    out = tmp_path / "four.json"
    check_mpi("proxy_run.py", 4, "calibrate", "--calibration-out", str(out), timeout=600)
    written = json.loads(out.read_text())
    assert {"meeting_ratio", "meeting_cap_us", "meeting_us"} <= set(written), written
    # every group shape a 4-rank mesh meets in, the whole job's as the node's own
    assert set(written["meeting_groups"]) == {"2x1", "4x1", "2x2"}, written
    assert written["meeting_groups"]["4x1"] == [written["meeting_ratio"],
                                                written["meeting_cap_us"]]
    cluster = load_cluster(str(out))
    assert cluster.gpus_per_node == 4
    assert cluster.intra.alpha_us > 0 and cluster.intra.bandwidth_GBps > 0
    if 4 > len(os.sched_getaffinity(0)):  # the ranks share the cores: no cap
        assert cluster.meeting_cap_us == 0, cluster

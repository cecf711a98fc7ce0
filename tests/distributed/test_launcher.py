"""Distributed tier for raf_dist.run (python/raf_dist/launcher/): workers started without
mpirun form one MPI world through the rendezvous store; a killed worker restarts the job from
its checkpoint with the same result as an uninterrupted mpiexec run; failures, signals and bad
input end every launcher quickly with a message. Every run has a hard timeout; all workers
here run on this one host (two "nodes" are two launchers on 127.0.0.1)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpi_launch import ROOT, WORKERS, assert_ranks_ok, check_mpi
from raf_dist.distributed.store import StoreClient


def _launch(*args, log_dir=None):
    """Start one launcher in a session of its own (killed whole on a test's timeout)."""
    cmd = [sys.executable, "-m", "raf_dist.run", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT,
                            start_new_session=True)


def _finish(proc, timeout):
    """(exit code, output, seconds) of a launcher; fails the test after ``timeout`` s."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its workers' shims end them when it is gone
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} did not finish within {timeout} s:\n{out}")
    return proc.returncode, out, time.monotonic() - start


def _run(*args, timeout=120):
    return _finish(_launch(*args), timeout)


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _no_process_left(pids):
    time.sleep(0.5)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not alive, f"workers {alive} outlived their launcher"


def test_killed_worker_resumes_from_checkpoint_like_an_uninterrupted_mpiexec_run(tmp_path):
    reference, elastic = tmp_path / "reference", tmp_path / "elastic"
    reference.mkdir(), elastic.mkdir()
    check_mpi("elastic_train.py", 2, reference, timeout=300)
    code, out, _ = _run("--nproc-per-node", 2, "--max-restarts", 1,
                        WORKERS / "elastic_train.py", elastic, 3, timeout=300)
    assert code == 0, out
    assert re.search(r"attempt 0 failed: rank 1 \(local rank 1 on node 0, host \S+\) was killed "
                     r"by signal 9 \(SIGKILL\); restarting every worker \(1 of 1", out), out
    # both resumed in the second attempt from the step-2 checkpoint
    assert_ranks_ok(out, 2, detail=r" \(attempt 1, resumed at step 2\)", prefixed=True)
    expected, got = np.load(reference / "final.npz"), np.load(elastic / "final.npz")
    assert sorted(expected.files) == sorted(got.files)
    for name in expected.files:  # same world size and level: resume is bitwise exact
        assert np.array_equal(expected[name], got[name]), name


# make test-slow: zero_train.py at N=4 under mpiexec is test_zero's mlp-n4 case; a 4-rank
# launcher world is test_two_nodes_on_one_host_form_one_world's, training under the launcher
# test_killed_worker_resumes_from_checkpoint_like_an_uninterrupted_mpiexec_run's
@pytest.mark.slow
@pytest.mark.parametrize("worker, levels", [("dp_train.py", ()), ("zero_train.py", ("2,3",))],
                         ids=["data-parallel", "zero-2-3"])
def test_four_workers_train_like_one_process(worker, levels):
    """4 workers started by the launcher (no mpiexec world) run the checks of test_data_parallel
    and test_zero: losses, parameters (and optimizer state) equal one process on the global
    batch, with DESIGN.md's collective counts and bytes, as under mpiexec."""
    code, out, _ = _run("--nproc-per-node", 4, WORKERS / worker, "mlp", "adamw", 0.001, 1,
                        *levels, timeout=420)
    assert code == 0, out
    assert_ranks_ok(out, 4, prefixed=True)


def test_killed_worker_without_restarts_ends_the_job_naming_it(tmp_path):
    code, out, seconds = _run("--nproc-per-node", 2, "--max-restarts", 0,
                              WORKERS / "launch_probe.py", "kill", timeout=120)
    assert code == 128 + 9 and seconds < 60, (code, seconds, out)
    assert re.search(r"job failed in attempt 0: rank 1 \(local rank 1 on node 0, host \S+\) was "
                     r"killed by signal 9 \(SIGKILL\); no restarts left \(--max-restarts 0\)",
                     out), out


def test_two_nodes_on_one_host_form_one_world(tmp_path):
    port = _free_port()
    nodes = [_launch("--nnodes", 2, "--node-rank", r, "--master-addr", "127.0.0.1",
                     "--master-port", port, "--rdzv-token", "t0k", "--nproc-per-node", 2,
                     WORKERS / "launch_probe.py", "info") for r in (1, 0)]  # node 1 first
    results = [_finish(node, 120) for node in nodes]
    infos = {}
    for code, out, _ in results:
        assert code == 0, out
        for line in re.findall(r"INFO (\{.*\})", out):
            info = json.loads(line)
            infos[info["rank"]] = info
    assert sorted(infos) == [0, 1, 2, 3], results
    for rank, info in infos.items():
        assert info["size"] == 4 and info["sum"] == 10.0 and info["env_rank"] == rank
        assert (info["node"], info["local_rank"], info["local_size"]) == (rank // 2, rank % 2, 2)


def test_a_failing_worker_on_one_node_ends_every_node(tmp_path):
    port = _free_port()
    nodes = [_launch("--nnodes", 2, "--node-rank", r, "--master-addr", "127.0.0.1",
                     "--master-port", port, "--rdzv-token", "t0k", "--nproc-per-node", 1,
                     "--log-dir", tmp_path / f"logs{r}", WORKERS / "launch_probe.py", "fail")
             for r in (0, 1)]
    for code, out, seconds in (_finish(node, 120) for node in nodes):
        assert code == 3 and seconds < 60, (code, seconds, out)
        assert re.search(r"job failed in attempt 0: rank 1 \(local rank 0 on node 1, host \S+\) "
                         r"exited with code 3", out), out
    log = (tmp_path / "logs0" / "rank0.log").read_text()  # one file per rank, no prefix
    assert log.startswith("==== raf_dist.run attempt 0 ====") and "[rank" not in log, log
    assert (tmp_path / "logs1" / "rank1.log").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_one_launcher_ends_every_worker_on_every_node(tmp_path, sig):
    port = _free_port()
    nodes = [_launch("--nnodes", 2, "--node-rank", r, "--master-addr", "127.0.0.1",
                     "--master-port", port, "--rdzv-token", "t0k", "--nproc-per-node", 1,
                     "--max-restarts", 3, WORKERS / "launch_probe.py", "sleep") for r in (0, 1)]
    pids, lines = [], []
    deadline = time.monotonic() + 120
    for node in nodes:  # both workers are running
        while time.monotonic() < deadline:
            line = node.stdout.readline()
            lines.append(line)
            found = re.search(r"running pid (\d+)", line)
            if found:
                pids.append(int(found.group(1)))
                break
    assert len(pids) == 2, "".join(lines)
    os.kill(nodes[1].pid, sig)
    for code, out, seconds in (_finish(node, 60) for node in nodes):
        assert code == 128 + sig and seconds < 30, (code, seconds, out)  # no restart
        assert f"the launcher of node 1 on" in out and f"received {sig.name}" in out, out
    _no_process_left(pids)


def test_a_worker_that_never_joins_is_named(tmp_path):
    code, out, seconds = _run("--nproc-per-node", 2, "--rdzv-timeout", 3,
                              WORKERS / "launch_probe.py", "nojoin", timeout=120)
    assert code != 0 and seconds < 60, (code, seconds, out)
    assert "rank 0: ranks [1] of 2 did not join within 3 s (--rdzv-timeout)" in out, out


def test_a_node_that_never_joins_is_named(tmp_path):
    code, out, seconds = _run("--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1",
                              "--master-port", _free_port(), "--rdzv-timeout", 2,
                              WORKERS / "launch_probe.py", "info", timeout=60)
    assert code == 1 and seconds < 30, (code, seconds, out)
    assert "job token: " in out  # node 0 made one for the others
    assert "node ranks [1] of --nnodes 2 did not join within 2 s" in out, out


def test_port_in_use_and_duplicate_node_rank_and_wrong_token(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, _ = _run("--master-port", port, WORKERS / "launch_probe.py", "info",
                            timeout=60)
        assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in out, out
        assert "pick another --master-port" in out, out
    port = _free_port()
    common = ("--nnodes", 3, "--master-addr", "127.0.0.1", "--master-port", port,
              "--rdzv-timeout", 20, WORKERS / "launch_probe.py", "info")
    node0 = _launch("--node-rank", 0, "--rdzv-token", "right", *common)
    store = StoreClient("127.0.0.1", port, "right", connect_timeout=60)  # node 0 serves
    code, out, _ = _run("--node-rank", 1, "--rdzv-token", "wrong", *common, timeout=60)
    assert code == 1 and "refused this job's token" in out, out
    node1 = _launch("--node-rank", 1, "--rdzv-token", "right", *common)
    deadline = time.monotonic() + 60
    while not store.check(["node/1"])[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    code, out, _ = _run("--node-rank", 1, "--rdzv-token", "right", *common, timeout=60)
    assert code == 1 and "node rank 1 is already taken by the launcher on" in out, out
    store.close()
    node0.send_signal(signal.SIGTERM)  # node 2 never comes: end the job
    for proc in (node0, node1):
        code, out, seconds = _finish(proc, 60)
        assert code != 0 and seconds < 15, (code, seconds, out)

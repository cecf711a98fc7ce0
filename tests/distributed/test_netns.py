"""Distributed tier across two "hosts": two network namespaces of this machine joined by a veth
pair, with addresses from 198.18.0.0/15 (reserved for network benchmarking; RFC 2544), so the
rendezvous store, MPI, the watchdogs and local-rank detection cross a real interface between
two different addresses. Each node runs in its namespace under a host name of its own (a UTS
namespace; the namespace's /etc/hosts, which `ip netns exec` mounts from
/etc/netns/NAME/hosts, names both nodes), except where a test gives both the same name.

Runs: raf_dist.run's two-node job (one launcher in each namespace, --master-addr = node A's
address) and `mpiexec --hostfile` over the two hosts, hydra entering node B's namespace through
`-launcher-exec`. Needs root and iproute2 (`ip`) and util-linux (`unshare`); skipped, saying
why, where the namespaces cannot be made. Traffic stays inside the two namespaces (no route
leaves them). Every process runs in a session of its own under a hard timeout (killed whole
on expiry), and the namespaces are deleted at the end whatever happened."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpi_launch import ROOT, WORKERS, assert_ranks_ok, check_mpi, launcher_is_open_mpi, mpiexec

PID = os.getpid()
SUBNET = PID % 256  # 198.18.SUBNET.0/24, private to this run's namespaces anyway


def _sh(*cmd, timeout=30):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


class TwoHosts:
    """Two namespaces ``ns[i]`` with host names ``names[i]`` at ``addrs[i]``."""

    def __init__(self, tmp):
        self.ns = [f"rdA{PID}", f"rdB{PID}"]
        self.names = [f"rd-a-{PID}", f"rd-b-{PID}"]
        self.addrs = [f"198.18.{SUBNET}.1", f"198.18.{SUBNET}.2"]
        self.veth = [f"rdv{PID}a", f"rdv{PID}b"]
        self.created = []
        self.tmp = tmp

    def up(self):
        for ns in self.ns:
            out = _sh("ip", "netns", "add", ns)
            if out.returncode != 0:
                pytest.skip(f"`ip netns add` failed ({out.stderr.strip()}): network namespaces "
                            f"cannot be created here")
            self.created.append(ns)
        steps = [("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])]
        for ns, veth, addr in zip(self.ns, self.veth, self.addrs):
            steps += [("ip", "link", "set", veth, "netns", ns),
                      ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth),
                      ("ip", "-n", ns, "link", "set", "lo", "up"),
                      ("ip", "-n", ns, "link", "set", veth, "up")]
        for step in steps:
            out = _sh(*step)
            if out.returncode != 0:
                pytest.skip(f"`{' '.join(step)}` failed ({out.stderr.strip()}): no veth pair "
                            f"between network namespaces here")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for addr, name in zip(self.addrs, self.names))
        for ns in self.ns:
            try:
                Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
                Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
            except OSError as err:
                pytest.skip(f"cannot write /etc/netns/{ns}/hosts ({err})")
        # hydra's bootstrap (an ssh stand-in): `nsexec.sh [options] HOST COMMAND`
        self.bootstrap = self.tmp / "nsexec.sh"
        cases = "".join(f"  {name}) ns={ns};;\n" for name, ns in zip(self.names, self.ns))
        self.bootstrap.write_text(
            "#!/bin/sh\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            'host=$1; shift\n'
            f'case $host in\n{cases}  *) echo "nsexec.sh: unknown host $host" >&2; exit 1;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare -u sh -c \'hostname "$0" && exec sh -c "$1"\' '
            '"$host" "$*"\n')
        self.bootstrap.chmod(0o755)
        probe = subprocess.run(self.command(1, ["cat", "/proc/sys/kernel/hostname"]),
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0 or probe.stdout.strip() != self.names[1]:
            pytest.skip(f"cannot give a namespace its own host name with `unshare -u` "
                        f"({probe.stderr.strip()})")
        ping = subprocess.run(self.command(1, [sys.executable, "-c", _CONNECT, self.addrs[0]]),
                              capture_output=True, text=True, timeout=30)
        assert "refused" in ping.stdout, f"the veth pair does not carry TCP: {ping.stdout}"
        return self

    def command(self, node, argv, hostname=None):
        """``argv`` in node's namespace under host name ``hostname`` (default: the node's)."""
        return ["ip", "netns", "exec", self.ns[node], "unshare", "-u", "sh", "-c",
                'hostname "$0" && exec "$@"', hostname or self.names[node], *map(str, argv)]

    def down(self):
        for ns in self.created:  # deleting a namespace deletes its end of the veth pair
            _sh("ip", "netns", "delete", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


# a TCP connect to a closed port of node A: "refused" proves the packet crossed the veth
_CONNECT = ("import socket, sys\ns = socket.socket(); s.settimeout(5)\n"
            "try:\n    s.connect((sys.argv[1], 9)); print('open')\n"
            "except ConnectionRefusedError:\n    print('refused')\n"
            "except OSError as e:\n    print(e)\n")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (iproute2 / util-linux)")
    bed = TwoHosts(tmp_path_factory.mktemp("netns"))
    try:
        yield bed.up()
    finally:
        bed.down()


def _start(cmd, env=None):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def _finish(proc, timeout):
    """(exit code, output) of a process we started; kills its session after ``timeout`` s."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our session only (a launcher's shims follow)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} did not finish within {timeout} s:\n{out}")
    return proc.returncode, out


def _two_node_job(hosts, script_args, port, hostnames=(None, None), timeout=240):
    procs = [_start(hosts.command(node, [
        sys.executable, "-m", "raf_dist.run", "--nnodes", 2, "--node-rank", node,
        "--master-addr", hosts.addrs[0], "--master-port", port, "--rdzv-token", "netns",
        "--rdzv-timeout", 120, "--nproc-per-node", 1, *script_args], hostnames[node]))
        for node in (1, 0)]  # node 1 first: it waits for node 0's store across the veth
    deadline = time.monotonic() + timeout
    return [_finish(p, max(1.0, deadline - time.monotonic())) for p in procs][::-1]


@pytest.mark.parametrize("same_name", [False, True], ids=["own-host-names", "one-host-name"])
def test_launcher_two_nodes_form_one_world_across_the_veth(hosts, same_name):
    names = ("twin", "twin") if same_name else (None, None)
    results = _two_node_job(hosts, [WORKERS / "launch_probe.py", "info"], 29400 + same_name,
                            hostnames=names)
    infos = {}
    for node, (code, out) in enumerate(results):
        assert code == 0, out
        # one kernel, two network namespaces: the launcher keeps UCX off shared memory
        assert "its workers run with UCX_TLS=^sysv,posix" in out, out
        for line in re.findall(r"INFO (\{.*\})", out):
            info = json.loads(line)
            infos[info["rank"]] = info
    assert sorted(infos) == [0, 1], results
    for rank, info in infos.items():
        assert (info["size"], info["sum"], info["env_rank"], info["node"]) == (2, 3.0, rank, rank)
        assert (info["local_rank"], info["local_size"]) == (0, 1), info  # by node, not by name
    expected = ["twin", "twin"] if same_name else hosts.names
    assert [infos[r]["host"] for r in (0, 1)] == expected


def test_launcher_two_nodes_train_like_a_single_host_mpiexec_run(hosts, tmp_path):
    reference, netns = tmp_path / "reference", tmp_path / "netns"
    reference.mkdir(), netns.mkdir()
    check_mpi("elastic_train.py", 2, reference, timeout=300)
    results = _two_node_job(hosts, [WORKERS / "elastic_train.py", netns], 29402, timeout=300)
    for node, (code, out) in enumerate(results):
        assert code == 0, out
        assert_ranks_ok(out, [node], detail=r" \(attempt 0, resumed at step 0\)", prefixed=True)
    expected, got = np.load(reference / "final.npz"), np.load(netns / "final.npz")
    assert sorted(expected.files) == sorted(got.files)
    for name in expected.files:  # same world size, level and reduction order: bitwise
        assert np.array_equal(expected[name], got[name]), name


def _mpiexec_over_hosts(hosts, nprocs, script, *args, timeout=240):
    """`mpiexec --hostfile` from node A over both hosts, one rank each (rank r on node r)."""
    if launcher_is_open_mpi():
        pytest.skip("the namespace bootstrap uses hydra's -launcher-exec (MPICH's mpiexec)")
    hostfile = hosts.tmp / "hostfile"
    hostfile.write_text("".join(f"{name}:1\n" for name in hosts.names))
    cmd = hosts.command(0, [mpiexec(), "-launcher", "ssh", "-launcher-exec", hosts.bootstrap,
                            "--hostfile", hostfile, "-n", nprocs, sys.executable,
                            WORKERS / script, *args])
    return _finish(_start(cmd), timeout)


def test_mpiexec_hostfile_data_parallel_training_across_the_veth(hosts):
    code, out = _mpiexec_over_hosts(hosts, 2, "dp_train.py", "mlp", "sgd_momentum,adamw", 25, 1)
    assert code == 0, out
    assert_ranks_ok(out, 2)


def test_mpiexec_hostfile_a_killed_rank_is_named_across_the_veth(hosts, tmp_path):
    start = time.monotonic()
    code, out = _mpiexec_over_hosts(hosts, 2, "fault_worker.py", tmp_path / "ckpt", 1, "kill",
                                    "step", timeout=120)
    assert code != 0 and time.monotonic() - start < 60, (code, out)
    b = hosts.names[1]
    # rank 1's watchdog names it; rank 0 on the other host hears it over UDP across the veth
    assert re.search(rf"rank 1/2 on {b} \(pid \d+\) died during step 4 \(last completed: 3\) "
                     r"without raising", out), out
    assert f"rank 0/2 on {hosts.names[0]}: ending the job: rank 1/2 on {b} (pid" in out, out


def test_worker_environment_only_where_a_kernel_is_shared_across_namespaces():
    from raf_dist.launcher.mpi_env import worker_environment

    a = {"kernel": "k1", "netns": "net:[1]", "ipcns": "ipc:[1]"}
    cases = [  # (the other node, what node 0's workers get)
        ({"kernel": "k2", "netns": "net:[9]", "ipcns": "ipc:[9]"}, {}),  # real hosts
        (dict(a), {}),  # two launchers in one namespace
        (dict(a, netns="net:[2]"), {"UCX_TLS": "^sysv,posix"}),  # network namespaces
        (dict(a, ipcns="ipc:[2]"), {"UCX_TLS": "^sysv,posix"}),  # containers sharing a net
        ({"kernel": None, "netns": None, "ipcns": None}, {}),  # no /proc: nothing known
    ]
    for other, expected in cases:
        env, note = worker_environment([a, other], 0, {})
        assert env == expected and (note is not None) == bool(expected), (other, env, note)
    env, note = worker_environment([a, dict(a, netns="net:[2]")], 0, {"UCX_TLS": "tcp"})
    assert env == {} and "keeping your UCX_TLS=tcp" in note

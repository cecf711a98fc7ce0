"""What a node's workers must tell their MPI so that the nodes' workers can connect.

Each node's launcher publishes where it runs (``host_identity``): the kernel's boot id and
this process's network and IPC namespaces. Two nodes with one kernel but different
namespaces are two "hosts" sharing a machine (containers, pods, network namespaces: the
test bed of ``tests/distributed/test_netns.py``). MPICH's default netmod, UCX, judges "same
machine" by the kernel alone (its system id is the boot id; host names play no part), so it
wires such workers over its shared-memory transports (``sysv``/``posix``): measured with the
mpich 5.0.2 wheel (UCX 1.20.1), ``MPI_Comm_connect``/``MPI_Comm_accept`` between two network
namespaces then never completes (both sides spin; the same pair in one namespace connects in
under a second, and excluding those two transports makes it connect over TCP at once).
``worker_environment`` then adds ``UCX_TLS=^sysv,posix`` to the workers' environment,
unless the user chose ``UCX_TLS`` already. Nodes on different kernels (real hosts) and nodes
in one namespace (several launchers on one host) get nothing: UCX picks its transports.
"""
import os
from typing import Dict, List, Mapping, Optional, Tuple

#: UCX's transports that cannot carry a connection between namespaces of one kernel
CROSS_NAMESPACE_UCX_TLS = "^sysv,posix"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _namespace(kind: str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def host_identity() -> Dict[str, Optional[str]]:
    """This process's kernel (boot id) and namespaces; None where the system does not say."""
    return {"kernel": _read("/proc/sys/kernel/random/boot_id"),
            "netns": _namespace("net"), "ipcns": _namespace("ipc")}


def shared_kernel_peers(nodes: List[Mapping], me: int) -> List[int]:
    """Other nodes on this node's kernel but in another network or IPC namespace."""
    mine = nodes[me]
    if not mine.get("kernel"):
        return []
    return [rank for rank, node in enumerate(nodes)
            if rank != me and node.get("kernel") == mine["kernel"]
            and (node.get("netns"), node.get("ipcns")) != (mine.get("netns"), mine.get("ipcns"))]


def worker_environment(nodes: List[Mapping], me: int,
                       environ: Mapping[str, str]) -> Tuple[Dict[str, str], Optional[str]]:
    """(variables to add to this node's workers' environment, a note for the user or None)."""
    peers = shared_kernel_peers(nodes, me)
    if not peers:
        return {}, None
    shared = (f"node {me} shares its kernel with node(s) {', '.join(map(str, peers))} but not "
              f"its network/IPC namespace, where MPI's (UCX's) shared-memory transports cannot "
              f"connect")
    if "UCX_TLS" in environ:
        return {}, f"{shared}; keeping your UCX_TLS={environ['UCX_TLS']}"
    return ({"UCX_TLS": CROSS_NAMESPACE_UCX_TLS},
            f"{shared}: its workers run with UCX_TLS={CROSS_NAMESPACE_UCX_TLS} (set UCX_TLS to "
            f"choose otherwise)")

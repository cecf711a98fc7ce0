"""raf_dist.run's command line, parsed and checked before anything starts.

Names and defaults follow torchrun; what differs: the rendezvous store binds to
``--master-addr`` (127.0.0.1 for a one-node job, which also gets a free port unless one is
given), and joining it needs a job token (``--rdzv-token``; node 0 makes one when none is
given, and a one-node job never needs to see it).
"""
import argparse
import re
import dataclasses
import secrets
import sys
from pathlib import Path
from typing import List, NoReturn, Optional, Sequence

#: torchrun's default port for a multi-node job
DEFAULT_MULTINODE_PORT = 29500


class LaunchError(RuntimeError):
    """A launch that cannot work as asked; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    max_restarts: int
    rdzv_timeout: float
    token: str
    token_generated: bool
    log_dir: Optional[Path]
    command: List[str]  # the worker's command line (python, script, its arguments)


class _Parser(argparse.ArgumentParser):
    """argparse, with the fix for mpirun's spellings in its "unrecognized arguments" error."""

    HINTS = {"-np": "use --nproc-per-node N (processes on this node)",
             "-n": "use --nproc-per-node N (processes on this node)",
             "--hostfile": "raf_dist.run takes no hostfile: start one launcher per node with "
                           "--nnodes / --node-rank / --master-addr, or use mpiexec --hostfile "
                           "without raf_dist.run",
             "-H": "raf_dist.run takes no host list: one launcher per node with --nnodes / "
                   "--node-rank / --master-addr"}

    def error(self, message: str) -> NoReturn:
        hints = [hint for flag, hint in self.HINTS.items()
                 if message.startswith("unrecognized arguments") and flag in message.split()]
        super().error(message + ("; " + "; ".join(dict.fromkeys(hints)) if hints else ""))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m raf_dist.run",
        description="Start this node's workers of a raf_dist job (torchrun conventions): each "
                    "sees RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT and RAF_DIST_RESTART_COUNT; dist.get_communicator() forms the "
                    "MPI world through node 0's rendezvous store.")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        help="workers on this node (default 1)")
    parser.add_argument("--nnodes", type=str, default="1",
                        help="number of nodes, each running this launcher (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this node's index, 0 .. nnodes-1; node 0 serves the store")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="node 0's address, reachable from every node; the store binds "
                             "to it (default 127.0.0.1, one node only)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help=f"the store's port (default: a free one for one node, "
                             f"{DEFAULT_MULTINODE_PORT} for several)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="restart every worker this many times after a failure (default 0)")
    parser.add_argument("--rdzv-timeout", "--rdzv_timeout", type=float, default=300.0,
                        help="seconds to wait for every node and every worker to join (300)")
    parser.add_argument("--rdzv-token", "--rdzv_token", default=None,
                        help="the job token every node must give (node 0 makes one if absent "
                             "and prints it for the other nodes)")
    parser.add_argument("--log-dir", "--log_dir", type=Path, default=None,
                        help="write each rank's output to LOG_DIR/rankR.log instead of "
                             "prefixing it with the rank on this terminal")
    parser.add_argument("script", help="the training script (a Python file)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def parse(argv: Sequence[str]) -> LaunchConfig:
    """The launch configuration of ``argv`` (without the program name); ``LaunchError`` names
    what is wrong with it. ``--help`` and argparse's own errors exit as argparse does."""
    args = _parser().parse_args(list(argv))
    if ":" in args.nnodes:
        raise LaunchError(f"--nnodes {args.nnodes}: a range of nodes (elastic membership) is "
                          f"not supported; give the fixed number of nodes")
    try:
        nnodes = int(args.nnodes)
    except ValueError:
        raise LaunchError(f"--nnodes {args.nnodes!r} is not a number of nodes") from None
    if nnodes < 1 or args.nproc_per_node < 1:
        raise LaunchError(f"--nnodes ({nnodes}) and --nproc-per-node ({args.nproc_per_node}) "
                          f"must be at least 1")
    if not 0 <= args.node_rank < nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} is outside 0..{nnodes - 1} "
                          f"(--nnodes {nnodes}): number the nodes 0 to {nnodes - 1}, one "
                          f"launcher each")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be 0 or more")
    if not args.rdzv_timeout > 0:
        raise LaunchError(f"--rdzv-timeout {args.rdzv_timeout} must be more than 0 seconds")
    master_addr = args.master_addr
    if master_addr is None:
        if nnodes > 1:
            raise LaunchError(
                f"--master-addr is required with --nnodes {nnodes}: give node 0's address, "
                f"one that every node can reach, to every launcher (node {args.node_rank} "
                f"has none)")
        master_addr = "127.0.0.1"
    port = args.master_port
    if port is None:
        port = 0 if nnodes == 1 else DEFAULT_MULTINODE_PORT
    if not 0 <= port < 65536:
        raise LaunchError(f"--master-port {port} is not a TCP port")
    token = args.rdzv_token
    if not token and args.node_rank > 0:
        raise LaunchError(f"node {args.node_rank} needs the job token: pass --rdzv-token with "
                          f"the token given to (or printed by) node 0's launcher")
    script = Path(args.script)
    if not script.is_file():
        if re.fullmatch(r"python[0-9.]*", script.name):  # `raf_dist.run python train.py`
            raise LaunchError(f"{args.script!r} is not a training script: raf_dist.run runs the "
                              f"script with Python itself, so drop {args.script!r} (python -m "
                              f"raf_dist.run --nproc-per-node N train.py ...)")
        raise LaunchError(f"the training script {args.script} "
                          f"{'is a directory' if script.is_dir() else 'does not exist'}: give "
                          "the path of a Python file")
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    return LaunchConfig(
        nproc_per_node=args.nproc_per_node, nnodes=nnodes, node_rank=args.node_rank,
        master_addr=master_addr, master_port=port, max_restarts=args.max_restarts,
        rdzv_timeout=args.rdzv_timeout, token=token or secrets.token_hex(16),
        token_generated=not token, log_dir=args.log_dir,
        command=[sys.executable, str(script), *script_args])

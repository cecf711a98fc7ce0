"""The node agent of raf_dist.run: rendezvous of the nodes, attempts, failures, restarts.

Modelled on torchelastic's ``SimpleElasticAgent`` (start the workers, watch them, on a failure
end every worker and restart all of them while restarts remain), with the store as the only
channel between nodes (as its c10d rendezvous backend):

- ``node/<r>``: each launcher's record (host, workers, its settings), claimed with
  ``compare_set`` so that two launchers with one ``--node-rank`` are refused; the last of the
  ``nnodes`` to arrive sets ``nodes/all``. Ranks are numbered node by node.
- ``attempt/<k>/failure``: the first failure of attempt k (a worker's exit code or signal, a
  launcher's SIGINT/SIGTERM), first writer wins (``compare_set``). Every launcher polls it
  (``POLL_SECONDS``), so a failure on any node ends the attempt everywhere within about
  ``POLL_SECONDS`` + ``workers.TERMINATE_GRACE_SECONDS``.
- ``attempt/<k>/done``: nodes whose workers all exited 0; the last sets ``attempt/<k>/all_done``
  (a node whose workers finished keeps watching: a failure elsewhere restarts it too).
- ``attempt/<k+1>/ready``, ``attempt/<k+1>/go``: every node has ended attempt k, restart.
- ``closed/<k>``: nodes that have read the outcome; node 0 serves the store until all have.

Every node takes the same decision from the same record (the settings are checked equal at
the rendezvous), so no leader is needed. Not supported: nodes joining or leaving between
attempts (``--nnodes MIN:MAX``); a node whose launcher is SIGKILLed is noticed through its
workers (they die with it, and their watchdogs end the others' ranks).
"""
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..distributed.rendezvous import RESTART_ENV, TIMEOUT_ENV, TOKEN_ENV
from ..distributed.store import StoreClient, StoreError, StoreServer
from .config import LaunchConfig, LaunchError
from .mpi_env import host_identity, worker_environment
from .workers import Worker, end_all, mpiexec

logger = logging.getLogger("raf_dist")

#: how often a launcher checks its workers and the store
POLL_SECONDS = 0.1
#: how long node 0 keeps serving the store for the others to read the outcome
CLOSE_SECONDS = 10.0


def _say(message: str) -> None:
    sys.stderr.write(f"[raf_dist.run] {message}\n")
    sys.stderr.flush()


class Agent:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.received: Optional[int] = None  # the signal that asked the job to stop
        self.server: Optional[StoreServer] = None
        self.store: Optional[StoreClient] = None
        self.port = config.master_port
        self.nodes: List[Dict] = []
        self.mpi_env: Dict[str, str] = {}  # what the workers' MPI needs (mpi_env.py)
        self._watching = False  # signals are handled by _watch (flag) or at once (raise)

    # -- rendezvous of the launchers -------------------------------------------------------

    def _open_store(self) -> None:
        cfg = self.config
        if cfg.node_rank == 0:
            self.server = StoreServer(cfg.master_addr, cfg.master_port, cfg.token)
            self.port = self.server.address[1]
            if cfg.token_generated and cfg.nnodes > 1:
                _say(f"job token: {cfg.token} (start the other nodes with --rdzv-token "
                     f"{cfg.token})")
        self.store = StoreClient(cfg.master_addr, self.port, cfg.token,
                                 connect_timeout=cfg.rdzv_timeout, timeout=cfg.rdzv_timeout)

    def _meet_nodes(self) -> None:
        cfg, store = self.config, self.store
        settings = {"nnodes": cfg.nnodes, "max_restarts": cfg.max_restarts}
        record = json.dumps({"host": self.host, "pid": os.getpid(),
                             "nproc": cfg.nproc_per_node, **host_identity(),
                             **settings}).encode()
        holder = store.compare_set(f"node/{cfg.node_rank}", b"", record)
        if holder != record:
            other = json.loads(holder)
            raise LaunchError(f"node rank {cfg.node_rank} is already taken by the launcher on "
                              f"{other['host']} (pid {other['pid']}): give each node its own "
                              f"--node-rank, 0..{cfg.nnodes - 1}")
        if store.add("nodes/joined", 1) == cfg.nnodes:
            store.set("nodes/all", b"1")
        try:
            store.get("nodes/all", timeout=cfg.rdzv_timeout)
        except TimeoutError:
            keys = [f"node/{r}" for r in range(cfg.nnodes)]
            missing = [r for r, present in enumerate(store.check(keys)) if not present]
            raise LaunchError(f"node ranks {missing} of --nnodes {cfg.nnodes} did not join "
                              f"within {cfg.rdzv_timeout:.0f} s (--rdzv-timeout): start a "
                              f"launcher for each of them with the same --master-addr, "
                              f"--master-port and --rdzv-token") from None
        self.nodes = [json.loads(store.get(f"node/{r}")) for r in range(cfg.nnodes)]
        for rank, node in enumerate(self.nodes):
            differs = {k: (node[k], v) for k, v in settings.items() if node[k] != v}
            if differs:
                raise LaunchError(
                    "launchers disagree: " + ", ".join(
                        f"--{k.replace('_', '-')} is {theirs} on node {rank} and {mine} on node "
                        f"{cfg.node_rank}" for k, (theirs, mine) in differs.items()))
        self.mpi_env, note = worker_environment(self.nodes, cfg.node_rank, os.environ)
        if note:
            _say(note)

    # -- one attempt -----------------------------------------------------------------------

    def _start(self, attempt: int, run_dir: Path) -> List[Worker]:
        cfg = self.config
        first_rank = sum(node["nproc"] for node in self.nodes[:cfg.node_rank])
        world_size = sum(node["nproc"] for node in self.nodes)
        workers = []
        for local_rank in range(cfg.nproc_per_node):
            rank = first_rank + local_rank
            env = dict(os.environ, **self.mpi_env, RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
                       GROUP_RANK=str(cfg.node_rank), MASTER_ADDR=cfg.master_addr,
                       MASTER_PORT=str(self.port), **{RESTART_ENV: str(attempt),
                                                      TOKEN_ENV: cfg.token,
                                                      TIMEOUT_ENV: str(cfg.rdzv_timeout)})
            log = None
            if cfg.log_dir is not None:
                cfg.log_dir.mkdir(parents=True, exist_ok=True)
                log = open(cfg.log_dir / f"rank{rank}.log", "a")
                log.write(f"==== raf_dist.run attempt {attempt} ====\n")
                log.flush()
            workers.append(Worker(rank, local_rank, cfg.command, env, run_dir, log))
        return workers

    def _report(self, attempt: int, record: Dict) -> bytes:
        """Publish a failure unless an earlier one is known; returns the one that counts."""
        return self.store.compare_set(f"attempt/{attempt}/failure", b"",
                                      json.dumps(record).encode())

    def _watch(self, attempt: int, workers: List[Worker]) -> Optional[Dict]:
        """Until the attempt ends everywhere: None on success, else the failure record."""
        cfg, store = self.config, self.store
        prefix = f"attempt/{attempt}/"
        reported_done = False
        while True:
            if self.received is not None and not store.check(["job/stop"])[0]:
                name = signal.Signals(self.received).name
                stop = json.dumps({
                    "final": True, "code": 128 + self.received, "node": cfg.node_rank,
                    "host": self.host, "what": f"the launcher of node {cfg.node_rank} on "
                                               f"{self.host} received {name}"}).encode()
                store.compare_set("job/stop", b"", stop)
            for worker in workers:
                ended = worker.poll()
                if ended is not None and ended.code != 0:
                    self._report(attempt, {
                        "final": False, "code": ended.code, "node": cfg.node_rank,
                        "host": self.host, "rank": worker.rank,
                        "what": f"rank {worker.rank} (local rank {worker.local_rank} on node "
                                f"{cfg.node_rank}, host {self.host}) {ended.cause}"})
            if not reported_done and all(w.poll() is not None for w in workers):
                reported_done = True  # every worker exited 0 (else a failure is recorded)
                if store.add(prefix + "done", 1) == cfg.nnodes:
                    store.set(prefix + "all_done", b"1")
            stopped, failed, all_done = store.check(
                ["job/stop", prefix + "failure", prefix + "all_done"])
            if stopped or failed:
                return json.loads(store.get("job/stop" if stopped else prefix + "failure"))
            if all_done:
                return None
            time.sleep(POLL_SECONDS)

    def _next_attempt(self, attempt: int) -> None:
        """Wait until every node has ended ``attempt``."""
        prefix = f"attempt/{attempt + 1}/"
        if self.store.add(prefix + "ready", 1) == self.config.nnodes:
            self.store.set(prefix + "go", b"1")
        deadline = time.monotonic() + self.config.rdzv_timeout
        while True:
            go, stopped = self.store.check([prefix + "go", "job/stop"])
            if stopped:  # a launcher was interrupted while the attempt ended
                raise LaunchError(json.loads(self.store.get("job/stop"))["what"])
            if go:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"not every node ended attempt {attempt} within "
                                  f"{self.config.rdzv_timeout:.0f} s (--rdzv-timeout)")
            time.sleep(POLL_SECONDS)

    def _close(self, attempt: int) -> None:
        """Tell node 0 this node has the outcome; node 0 serves until all have it."""
        try:
            closed = self.store.add(f"closed/{attempt}", 1)
            if self.server is not None:
                deadline = time.monotonic() + CLOSE_SECONDS
                while closed < self.config.nnodes and time.monotonic() < deadline:
                    time.sleep(POLL_SECONDS)
                    closed = self.store.add(f"closed/{attempt}", 0)
        except StoreError:
            pass  # node 0 is gone: nobody is left to tell

    # -- the job ---------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job on this node; returns the launcher's exit code."""
        cfg = self.config
        mpiexec()  # no MPI launcher: say so before anything starts
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        workers: List[Worker] = []
        attempt = 0
        # removed only after the workers have ended: they are signalled through files in it
        run_dir = tempfile.TemporaryDirectory(prefix="raf_dist_run_")
        try:
            self._open_store()
            self._meet_nodes()
            while True:
                workers = self._start(attempt, Path(run_dir.name))
                self._watching = True
                failure = self._watch(attempt, workers)
                self._watching = False
                end_all(workers)
                workers = []
                if failure is None:
                    self._close(attempt)
                    return 0
                left = cfg.max_restarts - attempt
                if failure["final"] or left <= 0 or self.received is not None:
                    why = "" if failure["final"] else (
                        f"; no restarts left (--max-restarts {cfg.max_restarts})")
                    _say(f"job failed in attempt {attempt}: {failure['what']}{why}")
                    self._close(attempt)
                    return failure["code"]
                _say(f"attempt {attempt} failed: {failure['what']}; restarting every "
                     f"worker ({cfg.max_restarts - left + 1} of {cfg.max_restarts} "
                     f"restarts)")
                self._next_attempt(attempt)
                attempt += 1
        except (LaunchError, StoreError, OSError) as err:
            _say(f"node {cfg.node_rank}: {err}")
            return 1
        except KeyboardInterrupt:  # a second SIGINT/SIGTERM: end at once
            _say(f"node {cfg.node_rank}: interrupted again; ending the workers")
            return 128 + (self.received or signal.SIGINT)
        finally:
            if workers:
                end_all(workers)
            run_dir.cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.store is not None:
                self.store.close()
            if self.server is not None:
                self.server.close()

    def _on_signal(self, signum: int, _frame) -> None:
        if self.received is not None:  # asked twice: stop waiting for anyone
            raise KeyboardInterrupt
        self.received = signum
        if not self._watching:  # nothing runs yet: stop waiting for the other nodes
            raise LaunchError(f"received {signal.Signals(signum).name} before the workers "
                              f"started")

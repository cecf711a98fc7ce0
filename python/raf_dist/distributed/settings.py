"""The failure-handling settings in force: a ``dist.get_config()`` field each, overridden by its
RAF_DIST_* environment variable when set (read and validated by ``raf_dist.env``)."""
from .. import env
from .config import DistConfig, get_config

# Ten minutes, as torch's NCCL default. Collectives run only inside steps, after the compile
# barriers, so the wait is the slowest rank's compute between two collectives of one step plus
# the transfer: seconds, not minutes. Compilation and checkpoint I/O sit behind idle barriers,
# which have their own, longer limit (below), so a slow compile on one rank cannot trip this.
DEFAULT_COLLECTIVE_TIMEOUT_S = DistConfig.collective_timeout_s  # 600
# An hour: the idle barriers wait for one rank's compile (minutes for a large model on a busy
# host) or its checkpoint file (1/N of the model, to possibly slow shared storage).
DEFAULT_BARRIER_TIMEOUT_S = DistConfig.barrier_timeout_s  # 3600


def collective_timeout_s() -> "float | None":
    """RAF_DIST_COLLECTIVE_TIMEOUT_S: how long a collective may wait, None = forever."""
    return env.seconds("RAF_DIST_COLLECTIVE_TIMEOUT_S", get_config().collective_timeout_s)


def barrier_timeout_s() -> "float | None":
    """RAF_DIST_BARRIER_TIMEOUT_S: how long Communicator.idle_barrier may wait, None = forever."""
    return env.seconds("RAF_DIST_BARRIER_TIMEOUT_S", get_config().barrier_timeout_s)


def check_collectives() -> bool:
    """RAF_DIST_CHECK_COLLECTIVES: every collective's signature compared across ranks first."""
    return env.switch("RAF_DIST_CHECK_COLLECTIVES", default=get_config().check_collectives)


def watchdog_enabled() -> bool:
    """RAF_DIST_WATCHDOG (default on): a per-rank watchdog process names a silently dead rank."""
    return env.switch("RAF_DIST_WATCHDOG", default=get_config().watchdog)


def watchdog_grace_s() -> float:
    """RAF_DIST_WATCHDOG_GRACE_S (default 10): how long the watchdog lets the launcher end its
    rank after a failure elsewhere."""
    return env.seconds("RAF_DIST_WATCHDOG_GRACE_S", get_config().watchdog_grace_s) or 10.0

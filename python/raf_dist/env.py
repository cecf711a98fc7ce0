"""The RAF_DIST_* environment variables that switch raf_dist's diagnostics, parsed and
validated here (the one place that reads them) so that a typo in a value fails at once with
the allowed values instead of being read as "off".

  RAF_DIST_STRICT_SCHEDULE=1   a kernel the CPU schedule cannot handle raises
                               (ScheduleFallbackError) instead of being logged and left
                               unscheduled; the test suite runs this way (tests/conftest.py)
  RAF_DIST_NO_SCHEDULE=1       skip the CPU schedule altogether (every kernel serial; for
                               measuring what the schedule gains)
  RAF_DIST_PROFILE=dir         every Trainer records its first RAF_DIST_PROFILE_STEPS steps
                               (default 10) and writes them as a Chrome trace to
                               ``dir/trace-rank{R}.json`` (Trainer.profile, raf_dist.profiler)
  RAF_DIST_COLLECTIVE_TIMEOUT_S=600  seconds a collective may wait before raising TimeoutError
                               (default 600; 0 or none: wait forever)
  RAF_DIST_BARRIER_TIMEOUT_S=3600    seconds Communicator.idle_barrier and .agree (the
                               barriers and agreements around compilation and checkpoint
                               I/O) may wait (default 3600; 0 or none: wait forever)
  RAF_DIST_CHECK_COLLECTIVES=1 ranks compare every collective's signature before it runs
  RAF_DIST_WATCHDOG=0          no per-rank watchdog process (default on)
  RAF_DIST_WATCHDOG_GRACE_S=10 seconds a watchdog lets the launcher end its rank after a
                               failure elsewhere before it terminates the rank

The five failure-handling settings (timeouts, collective checks, watchdog) are also fields of
``dist.get_config()`` (collective_timeout_s, ...); the environment variable, when set,
overrides the field.

The README lists every RAF_DIST_* variable, including the few read elsewhere (launcher
variables set by ``raf_dist.run``, build settings).
"""
import os

from .distributed.config import DistConfig, get_config

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a switch: set it to one of "
                     f"{', '.join(_TRUE)} (on) or {', '.join(repr(v) for v in _FALSE)} (off)")


def strict_schedules() -> bool:
    """RAF_DIST_STRICT_SCHEDULE: a scheduling fallback raises instead of logging."""
    return _flag("RAF_DIST_STRICT_SCHEDULE")


def skip_schedules() -> bool:
    """RAF_DIST_NO_SCHEDULE: leave every generated kernel unscheduled."""
    return _flag("RAF_DIST_NO_SCHEDULE")


def profile_dir() -> "str | None":
    """RAF_DIST_PROFILE: the directory every Trainer writes its per-rank trace to, or None."""
    value = os.environ.get("RAF_DIST_PROFILE", "").strip()
    return value or None


_DEFAULT_PROFILE_STEPS = 10  # enough to see the first step's warm-up and a few steady ones


def profile_steps() -> int:
    """RAF_DIST_PROFILE_STEPS: how many steps RAF_DIST_PROFILE records (a positive integer)."""
    value = os.environ.get("RAF_DIST_PROFILE_STEPS", "").strip()
    if not value:
        return _DEFAULT_PROFILE_STEPS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"RAF_DIST_PROFILE_STEPS={value!r}: give a positive number of steps "
                         f"(default {_DEFAULT_PROFILE_STEPS})")
    return int(value)


# Ten minutes, as torch's NCCL default. Collectives run only inside steps, after the compile
# barriers, so the wait is the slowest rank's compute between two collectives of one step plus
# the transfer: seconds, not minutes. Compilation and checkpoint I/O sit behind idle barriers,
# which have their own, longer limit (below), so a slow compile on one rank cannot trip this.
DEFAULT_COLLECTIVE_TIMEOUT_S = DistConfig.collective_timeout_s  # 600
# An hour: the idle barriers wait for one rank's compile (minutes for a large model on a busy
# host) or its checkpoint file (1/N of the model, to possibly slow shared storage).
DEFAULT_BARRIER_TIMEOUT_S = DistConfig.barrier_timeout_s  # 3600
_NO_TIMEOUT = ("0", "none", "off", "inf")


def _seconds(name: str, default: float) -> "float | None":
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default or None  # a config field of 0: forever
    if value in _NO_TIMEOUT:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={os.environ[name]!r} is not a timeout: give a number of seconds "
                         f"(default {default:g}), or 0 / none to wait forever")
    return seconds


def collective_timeout_s() -> "float | None":
    """RAF_DIST_COLLECTIVE_TIMEOUT_S: how long a collective may wait, None = forever."""
    return _seconds("RAF_DIST_COLLECTIVE_TIMEOUT_S", get_config().collective_timeout_s)


def barrier_timeout_s() -> "float | None":
    """RAF_DIST_BARRIER_TIMEOUT_S: how long Communicator.idle_barrier may wait, None = forever."""
    return _seconds("RAF_DIST_BARRIER_TIMEOUT_S", get_config().barrier_timeout_s)


def check_collectives() -> bool:
    """RAF_DIST_CHECK_COLLECTIVES: every collective's signature compared across ranks first."""
    return _flag("RAF_DIST_CHECK_COLLECTIVES", default=get_config().check_collectives)


def watchdog_enabled() -> bool:
    """RAF_DIST_WATCHDOG (default on): a per-rank watchdog process names a silently dead rank."""
    return _flag("RAF_DIST_WATCHDOG", default=get_config().watchdog)


def watchdog_grace_s() -> float:
    """RAF_DIST_WATCHDOG_GRACE_S (default 10): how long the watchdog lets the launcher end its
    rank after a failure elsewhere."""
    return _seconds("RAF_DIST_WATCHDOG_GRACE_S", get_config().watchdog_grace_s) or 10.0

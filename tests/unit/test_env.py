"""raf_dist.env: the RAF_DIST_* timeouts parse strictly (a typo fails with the allowed values
instead of silently meaning "no timeout") and are on by default."""
import pytest

from raf_dist.distributed import settings as env  # the config-backed RAF_DIST_* settings


@pytest.mark.parametrize("reader, name, default", [
    (env.collective_timeout_s, "RAF_DIST_COLLECTIVE_TIMEOUT_S", env.DEFAULT_COLLECTIVE_TIMEOUT_S),
    (env.barrier_timeout_s, "RAF_DIST_BARRIER_TIMEOUT_S", env.DEFAULT_BARRIER_TIMEOUT_S),
])
def test_timeouts_parse_strictly(monkeypatch, reader, name, default):
    monkeypatch.delenv(name, raising=False)
    assert reader() == default and default > 0  # on unless switched off
    for off in ("0", "none", "None", " off "):
        monkeypatch.setenv(name, off)
        assert reader() is None
    monkeypatch.setenv(name, "2.5")
    assert reader() == 2.5
    for bad in ("abc", "-3", "nan", "10s"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}=.*not a timeout.*0 / none"):
            reader()


def test_the_runtime_settings_are_config_fields_the_environment_overrides(monkeypatch,
                                                                          dist_config):
    from raf_dist.distributed import config as config_module

    for name in ("RAF_DIST_COLLECTIVE_TIMEOUT_S", "RAF_DIST_WATCHDOG", "RAF_DIST_CHECK_COLLECTIVES"):
        monkeypatch.delenv(name, raising=False)
    config = dist_config  # its reset() afterwards restores these fields even once started
    monkeypatch.setattr(config_module, "_STARTED", False)
    config.collective_timeout_s, config.watchdog, config.check_collectives = 30, False, True
    assert (env.collective_timeout_s(), env.watchdog_enabled(), env.check_collectives()) == (
        30.0, False, True)
    config.collective_timeout_s = 0  # forever
    assert env.collective_timeout_s() is None
    monkeypatch.setenv("RAF_DIST_COLLECTIVE_TIMEOUT_S", "7")  # the environment wins
    assert env.collective_timeout_s() == 7.0
    with pytest.raises(ValueError, match="collective_timeout_s must be a number of seconds"):
        config.collective_timeout_s = -1
    with pytest.raises(TypeError, match="watchdog must be True or False"):
        config.watchdog = "no"
    monkeypatch.setattr(config_module, "_STARTED", True)  # the process joined the job
    with pytest.raises(ValueError, match="set dist.get_config\\(\\).watchdog_grace_s before the "
                                         "first get_communicator"):
        config.watchdog_grace_s = 3

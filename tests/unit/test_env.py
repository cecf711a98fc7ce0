"""raf_dist.env: the RAF_DIST_* timeouts parse strictly (a typo fails with the allowed values
instead of silently meaning "no timeout") and are on by default."""
import pytest

from raf_dist import env


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

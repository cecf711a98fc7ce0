"""raf_dist.run's command line (raf_dist/launcher/config.py): defaults, and every input that
cannot work refused with what to change, before anything starts."""
import sys

import pytest

from raf_dist.launcher import LaunchError, parse


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_one_node_defaults(script):
    cfg = parse(["--nproc-per-node", "2", script, "--lr", "1e-3"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port) == (1, 0, "127.0.0.1", 0)
    assert cfg.max_restarts == 0 and cfg.rdzv_timeout == 300 and cfg.log_dir is None
    assert cfg.command == [sys.executable, script, "--lr", "1e-3"]
    assert cfg.token_generated and len(cfg.token) == 32
    assert parse([script]).token != cfg.token  # a fresh token per job


def test_multi_node_uses_the_given_address_port_and_token(script):
    cfg = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--rdzv-token", "secret", "--max-restarts", "3", script])
    assert (cfg.master_addr, cfg.master_port, cfg.token) == ("10.0.0.1", 29500, "secret")
    assert not cfg.token_generated and cfg.max_restarts == 3


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-token", "t"],
     "--master-addr is required with --nnodes 2: give node 0's address"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     r"--node-rank 2 is outside 0..1 \(--nnodes 2\)"),
    (["--node-rank", "-1"], r"--node-rank -1 is outside 0..0"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "h"],
     "node 1 needs the job token: pass --rdzv-token"),
    (["--nnodes", "1:4"], "a range of nodes .* is not supported"),
    (["--nproc-per-node", "0"], "must be at least 1"),
    (["--max-restarts", "-1"], "--max-restarts -1 must be 0 or more"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout 0.0 must be more than 0 seconds"),
    (["--master-port", "70000"], "--master-port 70000 is not a TCP port"),
])
def test_bad_input_names_the_fix(script, argv, message):
    with pytest.raises(LaunchError, match=message):
        parse([*argv, script])


def test_missing_script_is_named(tmp_path):
    with pytest.raises(LaunchError, match="the training script .*nope.py does not exist"):
        parse([str(tmp_path / "nope.py")])

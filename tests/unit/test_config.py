"""dist.get_config(): defaults, validation at assignment, cross-field rule."""
import pytest

from raf_dist import distributed as dist


@pytest.fixture
def cfg(dist_config):
    return dist_config  # tests/conftest.py: the defaults, restored after each test


def test_defaults(cfg):
    assert cfg.as_dict() == {
        "enable_data_parallel": False,
        "zero_opt_level": 0,
        "bucket_size_mb": 25.0,
        "overlap_comm": True,
        "sync_batch_norm": False,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "context_parallel_size": 1,
        "context_parallel_method": "ring",
        "expert_parallel_size": 1,
        "sequence_parallel": False,
        "num_microbatches": 1,
        "pipeline_schedule": "1f1b",
        "pipeline_stages_per_rank": 2,
        "pipeline_split_points": None,
        "activation_checkpointing": False,
        "activation_memory_budget_mb": None,
        "embedding_parallel": "none",
        "collective_timeout_s": 600.0,
        "barrier_timeout_s": 3600.0,
        "check_collectives": False,
        "watchdog": True,
        "watchdog_grace_s": 10.0,
    }
    assert dist.get_config() is cfg


def test_valid_assignments(cfg):
    cfg.enable_data_parallel = True
    cfg.zero_opt_level = 3
    cfg.bucket_size_mb = 0.5
    cfg.overlap_comm = False
    cfg.check()
    assert (cfg.zero_opt_level, cfg.bucket_size_mb, cfg.overlap_comm) == (3, 0.5, False)


def test_unknown_field_names_the_fields(cfg):
    with pytest.raises(AttributeError, match="zero_opt_level"):
        cfg.zero_level = 2


@pytest.mark.parametrize("value", [4, -1, 1.5, "2", True, None])
def test_bad_zero_level_names_allowed_values(cfg, value):
    with pytest.raises(ValueError, match=r"one of \(0, 1, 2, 3\)"):
        cfg.zero_opt_level = value
    assert cfg.zero_opt_level == 0  # the bad value was not stored


@pytest.mark.parametrize("value", [0, -5, "25", True])
def test_bad_bucket_size(cfg, value):
    with pytest.raises(ValueError, match="positive number"):
        cfg.bucket_size_mb = value


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size",
                                   "num_microbatches"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_mesh_sizes(cfg, field, value):
    with pytest.raises(ValueError, match="int >= 1"):
        setattr(cfg, field, value)


def test_pipeline_schedule_names_the_schedules(cfg):
    cfg.pipeline_schedule = "gpipe"
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        cfg.pipeline_schedule = "1F1B"


def test_the_zero_bubble_schedule_is_refused_by_name(cfg):
    cfg.pipeline_parallel_size = 2
    cfg.pipeline_schedule = "zero_bubble"
    with pytest.raises(NotImplementedError, match="zero_bubble' is not built"):
        cfg.check_supported()


def test_tensor_pipeline_parallelism_and_gradient_accumulation_are_built(cfg):
    cfg.tensor_parallel_size = 2
    cfg.pipeline_parallel_size = 2
    cfg.num_microbatches = 4
    cfg.check_supported()  # tests/distributed/test_{tensor_parallel,pipeline}.py


@pytest.mark.parametrize("field,value,match", [
    ("pipeline_stages_per_rank", 1, "int >= 2"),
    ("pipeline_split_points", "layers.4", "list of module names"),
    ("pipeline_split_points", ["layers.4", 3], "list of module names"),
])
def test_pipeline_fields_reject_bad_values(cfg, field, value, match):
    with pytest.raises(ValueError, match=match):
        setattr(cfg, field, value)


@pytest.mark.parametrize("field", ["enable_data_parallel", "overlap_comm", "sync_batch_norm"])
def test_bool_fields_reject_ints(cfg, field):
    with pytest.raises(TypeError, match="True or False"):
        setattr(cfg, field, 1)


def test_zero_without_data_parallel_is_rejected(cfg):
    cfg.zero_opt_level = 2
    with pytest.raises(ValueError, match="requires enable_data_parallel=True"):
        cfg.check()


def test_update_from_dict(cfg):
    cfg.update({"enable_data_parallel": True, "zero_opt_level": 1})
    assert cfg.zero_opt_level == 1
    with pytest.raises(AttributeError):
        cfg.update({"enable_dp": True})

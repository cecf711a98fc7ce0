"""The distribution switches a user script flips before building a Trainer.

The Trainer reads this object once and turns it into explicit pass arguments; no pass reads it
(DESIGN.md section 2). Every assignment is validated at once, so a typo or a bad value fails
on the line that wrote it, long before any collective starts.
"""
import dataclasses

_ZERO_LEVELS = (0, 1, 2, 3)


@dataclasses.dataclass
class DistConfig:
    """Distribution settings.

    Attributes:
        enable_data_parallel: average gradients across ranks (DP / ZeRO). Default False.
        zero_opt_level: 0 (plain DP), 1 (shard optimizer state), 2 (+ shard gradients),
            3 (+ shard parameters). Levels above 0 require data parallelism.
        bucket_size_mb: gradient bucket size for the collectives, in MB (> 0). Default 25.
        overlap_comm: start each bucket's collective as soon as it is ready. Default True.
    """

    enable_data_parallel: bool = False
    zero_opt_level: int = 0
    bucket_size_mb: float = 25.0
    overlap_comm: bool = True

    def __setattr__(self, name, value):
        fields = {f.name for f in dataclasses.fields(self)}
        if name not in fields:
            raise AttributeError(
                f"DistConfig has no field {name!r}; the fields are: {', '.join(sorted(fields))}"
            )
        object.__setattr__(self, name, _validate(name, value))

    def update(self, values):
        """Set several fields from a mapping (e.g. a script's ``raf_dist_config`` dict)."""
        for name, value in dict(values).items():
            setattr(self, name, value)
        self.check()
        return self

    def check(self):
        """Cross-field rules, checked by the Trainer before it builds anything."""
        if self.zero_opt_level > 0 and not self.enable_data_parallel:
            raise ValueError(
                f"zero_opt_level={self.zero_opt_level} shards state across data-parallel "
                "ranks, so it requires enable_data_parallel=True; set "
                "dist.get_config().enable_data_parallel = True or use zero_opt_level=0"
            )

    def reset(self):
        """Back to the defaults (tests use this between cases)."""
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, field.default)
        return self

    def as_dict(self):
        return dataclasses.asdict(self)


def _validate(name, value):
    if name in ("enable_data_parallel", "overlap_comm"):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    if name == "zero_opt_level":
        if isinstance(value, bool) or value not in _ZERO_LEVELS:
            raise ValueError(
                f"zero_opt_level must be one of {_ZERO_LEVELS} (0 = plain data parallel, "
                f"1 = optimizer state, 2 = + gradients, 3 = + parameters), got {value!r}"
            )
        return int(value)
    if name == "bucket_size_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"bucket_size_mb must be a positive number of MB, got {value!r}")
        return float(value)
    return value


_CONFIG = DistConfig()


def get_config():
    """The process-wide distribution config (a singleton, like RAF's ``dist.get_config()``)."""
    return _CONFIG

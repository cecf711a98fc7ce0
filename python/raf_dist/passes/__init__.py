"""raf_dist's Relax passes. Each is a function of the IRModule and explicit arguments: no pass
reads a global config or a communicator (DESIGN.md section 2)."""
from .bucketing import assign_buckets, bucket_layout, gradient_buckets
from .data_parallel import AllReduceGradients
from .dispatch_blas import DispatchToBLAS
from .fast_math import FastExp, FastGelu
from .pool_gradient import MaxPoolGradient
from ..layout import shard_size
from .zero import ShardZeRO
from .gradient_markers import StripGradientMarkers

__all__ = ["AllReduceGradients", "DispatchToBLAS", "FastExp", "FastGelu", "MaxPoolGradient",
           "StripGradientMarkers", "ShardZeRO", "assign_buckets", "bucket_layout",
           "gradient_buckets", "shard_size"]

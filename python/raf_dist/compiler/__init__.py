"""Compiler: lowering, CPU schedules, memory planning and build with an on-disk cache."""
from .build import CompiledStep, compile_step, default_cache_dir, plan_memory
from .memory import planned_bytes
from .schedule import ScheduleCPU
from .threads import available_cores, set_num_threads

__all__ = ["CompiledStep", "ScheduleCPU", "available_cores", "compile_step", "default_cache_dir",
           "plan_memory", "planned_bytes", "set_num_threads"]

"""Compiler: lowering, CPU schedules, memory planning and build with an on-disk cache."""
from .build import CompiledStep, compile_step, default_cache_dir, plan_memory
from .memory import planned_bytes
from .schedule_cpu import ScheduleCPU

__all__ = ["CompiledStep", "ScheduleCPU", "compile_step", "default_cache_dir", "plan_memory",
           "planned_bytes"]

"""Know before you launch: predicted peak memory and FLOPs of every method (``shared-prefix-logps plan``).

``plan(model, workload, engine)`` gives one :class:`MethodPlan` per method; ``predicted_peak_bytes`` the single
number a test bounds a measurement by. The terms are written out in :mod:`.memory` and :mod:`.flops`.
"""

from .api import MethodPlan, bench_workload, max_generations, plan, predicted_peak_bytes
from .dims import ModelDims, load_dims
from .flops import FlopCount, count_flops, flop_floor
from .memory import METHODS, MemoryPlan, plan_memory
from .workload import Engine, Workload, parse_memory_size

__all__ = [
    "METHODS",
    "Engine",
    "FlopCount",
    "MemoryPlan",
    "MethodPlan",
    "ModelDims",
    "Workload",
    "bench_workload",
    "count_flops",
    "flop_floor",
    "load_dims",
    "max_generations",
    "parse_memory_size",
    "plan",
    "plan_memory",
    "predicted_peak_bytes",
]

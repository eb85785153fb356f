"""``plan``: every method's predicted peak memory and FLOPs for a model, workload and engine."""

from __future__ import annotations

from dataclasses import dataclass

from .dims import ModelDims, load_dims
from .flops import FlopCount, count_flops
from .memory import METHODS, MemoryPlan, plan_memory
from .workload import Engine, Workload


@dataclass(frozen=True)
class MethodPlan:
    """One method's prediction: peak memory per device (with its terms), FLOPs, and whether it fits."""

    memory: MemoryPlan
    flops: FlopCount
    fits: bool | None

    def record(self) -> dict:
        """A JSON-ready record: method, peak_bytes, fits, flops (total and parts) and the memory breakdown."""
        return {
            "method": self.memory.method,
            "peak_bytes": self.memory.peak_bytes,
            "fits": self.fits,
            "flops": self.flops.total,
            "flops_breakdown": self.flops.parts,
            "breakdown": dict(self.memory.terms),
        }


def plan(
    model: str | dict | ModelDims,
    workload: Workload,
    engine: Engine | None = None,
    methods=METHODS,
    *,
    layers: int | None = None,
) -> list[MethodPlan]:
    """Predicted peak bytes per device and FLOPs of each of ``methods``.

    Args:
        model: a bench preset name, a ``config.json`` path or a config dict (``layers`` overrides its depth).
        workload: the batch and the step (:class:`~.workload.Workload`).
        engine: the device(s) (:class:`~.workload.Engine`, default one CUDA device).
        methods: names from :data:`~.memory.METHODS`.
    """
    dims = load_dims(model).with_layers(layers)
    engine = engine or Engine()
    plans = []
    for method in methods:
        memory = plan_memory(method, dims, workload, engine)
        fits = None if engine.memory_bytes is None else memory.peak_bytes <= engine.memory_bytes
        plans.append(MethodPlan(memory, count_flops(method, dims, workload, device=engine.device), fits))
    return plans


#: Terms allocated before a step starts (parameters, optimizer states, an FSDP unit's unsharded copy).
MODEL_STATE_TERMS = ("parameters", "optimizer states", "unsharded layer")


def predicted_peak_bytes(
    method: str,
    model,
    workload: Workload,
    *,
    device: str = "cuda",
    layers=None,
    step_only: bool = False,
    head_implementation: str | None = None,
) -> int:
    """Predicted peak bytes of one ``method`` step on one device.

    ``device='cpu'`` predicts what ``bench --device cpu`` measures (live tensor bytes allocated inside the step);
    ``step_only=True`` on ``cuda`` leaves out what exists before the step (:data:`MODEL_STATE_TERMS`), as
    ``bench``'s CUDA measurement (peak allocated minus what was allocated before) does. ``head_implementation``:
    the fused head's statistics (:class:`~.workload.Engine`; None: the device's default). The GPU peak-memory test
    bounds its measurement by this (x 1.2), and a CPU test checks it on the CUDA code path.
    """
    dims = load_dims(model).with_layers(layers)
    memory = plan_memory(method, dims, workload, Engine(device=device, head_implementation=head_implementation))
    if step_only:
        return memory.peak_bytes - sum(memory.terms.get(name, 0) for name in MODEL_STATE_TERMS)
    return memory.peak_bytes


def max_generations(model, workload: Workload, engine: Engine, method: str, *, limit: int = 4096, layers=None) -> int:
    """Largest power-of-two G for which ``method`` fits ``engine.memory_bytes`` (0 if G = 1 does not)."""
    if engine.memory_bytes is None:
        raise ValueError("max_generations needs the device memory (--gpu-memory)")
    dims = load_dims(model).with_layers(layers)
    best, g = 0, 1
    while g <= limit:
        if plan_memory(method, dims, workload.with_generations(g), engine).peak_bytes > engine.memory_bytes:
            break
        best, g = g, g * 2
    return best


def bench_workload(prompts: int, prompt_len: int, completion_len: int, generations: int, **options) -> Workload:
    """The workload ``bench`` runs for this shape: its real completion tokens (``bench.runner.make_batch``)."""
    from ..bench.runner import Shape, make_batch

    batch = make_batch(Shape(prompts, prompt_len, completion_len, generations), vocab=2, device="cpu")
    return Workload(
        prompts,
        prompt_len,
        completion_len,
        generations,
        scored_tokens=int(batch.completion_mask.sum()),
        prompt_tokens=int(batch.prompt_mask.sum()),
        padded_prompts=not bool(batch.prompt_mask.all()),
        **options,
    )

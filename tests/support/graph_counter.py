"""A ``torch.compile`` backend that counts the graphs it receives, flex_attention graphs and block-mask graphs apart,
and compiles them with ``aot_eager`` (CPU tests) or inductor (GPU tests)."""

from __future__ import annotations

import collections

#: The smallest query/key/value head dimension inductor's CUDA flex_attention lowering accepts.
CUDA_FLEX_MIN_HEAD_DIM = 16


class GraphCounter:
    """Counts compilations in ``counts["flex"]`` and ``counts["mask"]``; ``compiler`` is ``"aot_eager"`` or
    ``"inductor"``. With ``cuda_rules`` it also refuses, as inductor's CUDA lowering does, a flex_attention graph whose
    query, key or value head dimension is below :data:`CUDA_FLEX_MIN_HEAD_DIM`, so CPU runs meet that rule."""

    def __init__(self, compiler: str = "aot_eager", *, cuda_rules: bool = False):
        if compiler not in ("aot_eager", "inductor"):
            raise ValueError(f"compiler must be 'aot_eager' or 'inductor', got {compiler!r}")
        self.compiler = compiler
        self.cuda_rules = cuda_rules
        self.counts = collections.Counter()

    def __call__(self, gm, example_inputs):
        is_flex = any("flex_attention" in str(node.target) for node in gm.graph.nodes)
        if is_flex and self.cuda_rules:
            _refuse_small_heads(gm)
        self.counts["flex" if is_flex else "mask"] += 1
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def _refuse_small_heads(gm) -> None:
    """Raise inductor's CUDA error when a flex_attention call of ``gm`` has a head dimension below the minimum."""
    for node in gm.graph.nodes:
        if "flex_attention" not in str(node.target):
            continue
        dims = [int(arg.meta["example_value"].shape[-1]) for arg in node.args[:3]]
        if min(dims) < CUDA_FLEX_MIN_HEAD_DIM:
            raise NotImplementedError(
                f"NYI: embedding dimension of the query, key, and value must be at least 16 but got {dims}"
            )


def compile_flex_on_cpu(monkeypatch) -> GraphCounter:
    """Compile the flex path on CPU with a counting ``aot_eager`` backend, and allow flex's backward there (torch
    refuses it up front on CPU although its reference backward runs); returns the counter."""
    from shared_prefix_logps.backends import flex

    counter = GraphCounter()
    monkeypatch.setitem(flex._COMPILE_BACKENDS, "cpu", counter)
    allow_flex_backward_on_cpu(monkeypatch)
    return counter


def allow_flex_backward_on_cpu(monkeypatch) -> None:
    """Let flex_attention's backward run on CPU: the library's own gate and torch's up-front device check both refuse
    it there, although torch's reference (eager) backward runs."""
    import torch.nn.attention.flex_attention as flex_module

    from shared_prefix_logps.backends import flex

    monkeypatch.setattr(flex, "_BACKWARD_DEVICES", flex._BACKWARD_DEVICES | {"cpu"})
    validate = flex_module._validate_device

    def validate_without_cpu_backward_refusal(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    monkeypatch.setattr(flex_module, "_validate_device", validate_without_cpu_backward_refusal)

"""A ``torch.compile`` backend that counts the graphs it receives, flex_attention graphs and block-mask graphs apart,
and compiles them with ``aot_eager`` (CPU tests) or inductor (GPU tests)."""

from __future__ import annotations

import collections


class GraphCounter:
    """Counts compilations in ``counts["flex"]`` and ``counts["mask"]``; ``compiler`` is ``"aot_eager"`` or
    ``"inductor"``."""

    def __init__(self, compiler: str = "aot_eager"):
        if compiler not in ("aot_eager", "inductor"):
            raise ValueError(f"compiler must be 'aot_eager' or 'inductor', got {compiler!r}")
        self.compiler = compiler
        self.counts = collections.Counter()

    def __call__(self, gm, example_inputs):
        is_flex = any("flex_attention" in str(node.target) for node in gm.graph.nodes)
        self.counts["flex" if is_flex else "mask"] += 1
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

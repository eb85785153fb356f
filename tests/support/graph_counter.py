"""A ``torch.compile`` backend that counts the graphs it receives, flex_attention graphs and block-mask graphs apart,
and compiles them with ``aot_eager`` (CPU tests) or inductor (GPU tests)."""

from __future__ import annotations

import collections

#: The smallest query/key/value head dimension inductor's CUDA flex_attention lowering accepts.
CUDA_FLEX_MIN_HEAD_DIM = 16


class GraphCounter:
    """Counts compilations in ``counts["flex"]`` and ``counts["mask"]``; ``compiler`` is ``"aot_eager"`` or
    ``"inductor"``. With ``cuda_rules`` it also applies, to every flex_attention graph, rules of inductor's CUDA
    lowering (torch 2.11 and 2.13, ``torch/_inductor/kernel/flex/flex_attention.py``), so CPU runs meet them:

    - a query, key or value head dimension below :data:`CUDA_FLEX_MIN_HEAD_DIM` is refused;
    - the forward configuration is the one inductor would compile on a GPU of ``capability`` (torch's own heuristics,
      ``fwd_`` kernel options first); a head dim the heuristics table lacks, rounded up to 256 inside the kernel,
      gets the generic default, whose shared memory at 256-wide tiles an sm90 block does not have: refused as Triton
      refuses it (``configs`` records each graph's configuration);
    - ``divisible`` records the IS_DIVISIBLE each graph's kernel would run with: the kernel option if given, else
      whether both lengths are provably multiples of 128.
    """

    def __init__(self, compiler: str = "aot_eager", *, cuda_rules: bool = False, capability=(9, 0)):
        if compiler not in ("aot_eager", "inductor"):
            raise ValueError(f"compiler must be 'aot_eager' or 'inductor', got {compiler!r}")
        self.compiler = compiler
        self.cuda_rules = cuda_rules
        self.capability = capability
        self.counts = collections.Counter()
        self.configs = []
        self.divisible = []

    def __call__(self, gm, example_inputs):
        is_flex = any("flex_attention" in str(node.target) for node in gm.graph.nodes)
        if is_flex and self.cuda_rules:
            _refuse_small_heads(gm)
            for node in _flex_nodes(gm):
                self.divisible.append(_is_divisible(node))
                config = forward_config(node, self.capability)
                if config is not None:
                    self.configs.append(config)
                    _refuse_untabled_wide_heads(config)
        self.counts["flex" if is_flex else "mask"] += 1
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def _flex_nodes(gm):
    return [node for node in gm.graph.nodes if "flex_attention" in str(node.target)]


def _kernel_options(node) -> dict:
    """The kernel options of a flex_attention graph node, ints resolved (dynamo passes them as symbolic inputs)."""
    (options,) = [arg for arg in node.args if isinstance(arg, dict)]
    return {
        key: int(value.meta["example_value"]) if hasattr(value, "meta") else value for key, value in options.items()
    }


def _is_divisible(node) -> bool:
    """IS_DIVISIBLE as the lowering decides it: the option if given, else both lengths provably multiples of 128."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    options = _kernel_options(node)
    if "IS_DIVISIBLE" in options:
        return bool(options["IS_DIVISIBLE"])
    lengths = [node.args[i].meta["example_value"].shape[-2] for i in (0, 1)]
    return all(statically_known_true(length % 128 == 0) for length in lengths)


def torch_forward_config(capability, dtype, head_dim):
    """(block_m, block_n, num_stages, num_warps) torch's CUDA heuristics give a head dim on a GPU of ``capability``
    without max-autotune, or None where this torch has no such class."""
    import torch

    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
    except ImportError:
        return None
    read = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: capability
    try:
        with inductor_config.patch(max_autotune=False):
            config = CUDAConfigHeuristic().get_flex_attn_fwd_configs(head_dim, dtype)[-1]
    finally:
        torch.cuda.get_device_capability = read
    return (config.block_m, config.block_n, config.num_stages, config.num_warps)


def forward_config(node, capability) -> dict | None:
    """The forward configuration inductor would compile for a flex_attention node: ``fwd_`` options over torch's
    heuristics; with the head dim and whether torch's table has an entry for it."""
    query = node.args[0].meta["example_value"]
    head_dim, dtype = int(query.shape[-1]), query.dtype
    default = torch_forward_config(capability, dtype, head_dim)
    if default is None:
        return None
    odd = head_dim - 1 if head_dim % 2 == 0 else head_dim - 2  # in no table: the generic default
    options = _kernel_options(node)
    names = ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps")
    chosen = tuple(options.get(f"fwd_{name}", options.get(name, value)) for name, value in zip(names, default))
    untabled = head_dim > 2 and default == torch_forward_config(capability, dtype, odd)
    return dict(head_dim=head_dim, dtype=dtype, config=chosen, default=default, untabled=untabled)


def _refuse_untabled_wide_heads(config: dict) -> None:
    """Triton's refusal of torch's generic default where the table lacks a head dim the kernel rounds up to 256."""
    head_dim = config["head_dim"]
    rounded = 1 << (head_dim - 1).bit_length()
    if rounded == 256 and head_dim != 256 and config["untabled"] and config["config"] == config["default"]:
        raise RuntimeError(
            f"out of resource: shared memory (emulated): head dim {head_dim} has no entry in torch's table, and its "
            f"default configuration {config['default']} at 256-wide tiles exceeds an sm90 block's shared memory"
        )


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

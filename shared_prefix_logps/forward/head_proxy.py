"""The lm_head proxy: installed as the head's ``forward`` on the instance, it runs inside the model's forward and
computes the fused log-probs of a node call's scored pairs (no logits) inside a node call, the module's own logits
otherwise. Module hooks of FSDP/ZeRO fire around it as around the original forward."""

from __future__ import annotations

import torch
from torch import nn

from .context import HeadCheckContext, active_context
from .head_weights import effective_head
from .routing import RouteBox, attach

#: Rows of completion tokens per chunk of the fused head; None lets the head size chunks from its memory budget.
HEAD_CHUNK_ROWS: int | None = None


def install_head_proxy(lm_head: nn.Module) -> None:
    """Make ``lm_head``'s forward (on the instance) a :class:`HeadProxy`; nothing if it already has one."""
    if isinstance(getattr(lm_head, _PROXY_ATTRIBUTE, None), HeadProxy):
        return
    # An instance-level forward (accelerate's hooks install one) is kept; otherwise the class's forward runs.
    proxy = HeadProxy(lm_head, lm_head.__dict__.get("forward"))
    # Also under its own name: a wrapper may later replace ``forward`` around the proxy (TRL's float32 head).
    setattr(lm_head, _PROXY_ATTRIBUTE, proxy)
    lm_head.forward = proxy


#: Attribute of the lm_head holding its :class:`HeadProxy`.
_PROXY_ATTRIBUTE = "_shared_prefix_head_proxy"


class HeadProxy:
    """The lm_head's ``forward`` on the instance: fused log-probs in a node call, the module's own forward otherwise.

    An object rather than a bound method so that the model stays picklable (``torch.save``, multiprocessing and Ray
    arguments): pickle stores a bound method as "look the name up on the instance", which the loaded module does
    not have. It holds the module and the forward it replaced, both picklable, and ``copy.deepcopy`` rebinds it to
    the copy.

    Attributes:
        module: the lm_head it serves.
        original: the instance-level forward the module had before (None: its class's ``forward``).
    """

    def __init__(self, module: nn.Module, original=None):
        self.module = module
        self.original = original

    def original_forward(self, hidden_states, *args, **kwargs):
        """The module's own forward: full logits."""
        if self.original is not None:
            return self.original(hidden_states, *args, **kwargs)
        return type(self.module).forward(self.module, hidden_states, *args, **kwargs)

    def __call__(self, hidden_states, *args, **kwargs):
        return _lm_head_proxy_forward(self, hidden_states, *args, **kwargs)

    def __setstate__(self, state):
        # Unpickled: the model it belongs to was prepared, perhaps in another process, and its config may name the
        # shared-prefix attention, which this process's registry must then hold before the model's next forward.
        self.__dict__.update(state)
        from .attention import register_eager_name

        register_eager_name()


def _lm_head_proxy_forward(proxy: HeadProxy, hidden_states, *args, **kwargs):
    """lm_head forward inside the model's forward: full logits normally, fused log-probs inside a node call.

    A module that is not the head of the running call or check (a head PEFT wrapped after first use keeps its proxy
    inside the wrapper, which calls it) runs its own forward: only the head the call was prepared with computes."""
    context = active_context()
    if context is None:
        return proxy.original_forward(hidden_states, *args, **kwargs)
    return _node_head_forward(proxy, context, hidden_states, *args, **kwargs)


@torch.compiler.disable
def _node_head_forward(proxy: HeadProxy, context, hidden_states, *args, **kwargs):
    """The lm_head inside the library's own forwards, run eagerly even inside a ``torch.compile``d model: it writes
    into the call's context and attaches routes whose backward reads gradients stored by another node, which a traced
    graph would freeze at its first call (the chunked fused head gains nothing from tracing either)."""
    self = proxy.module
    if isinstance(context, HeadCheckContext):
        logits = proxy.original_forward(hidden_states, *args, **kwargs)
        if context.spec.lm_head is self:
            context.calls += 1
            with torch.no_grad():
                context.fused_logits = fused_logits(self, context.spec, hidden_states)
        return logits
    if context.head_spec.lm_head is not self:
        return proxy.original_forward(hidden_states, *args, **kwargs)
    # A node call returns no logits: the model gets a tensor of the right rank with an empty vocabulary axis, for
    # any post-processing it applies. It is a view of the hidden states, so gradient reaching the model's output
    # flows on into the model (wrappers' backward hooks fire on the way), and DDP's unused-parameter search walks it.
    # Packed node tokens: a hidden state may predict several targets (a node's last token, one per child).
    if context.non_finite is not None:
        context.non_finite.record_hidden(hidden_states)  # an optimistic call's one finiteness check
    hidden = hidden_states.flatten(0, -2)[context.call.head_index]
    from ..kernels.fused_head import linear_logps

    spec = context.head_spec
    if spec.scale != 1.0:
        hidden = hidden * spec.scale
    weight, bias = effective_head(self)
    grads = context.weight_grads
    results = linear_logps(
        hidden,
        weight,
        context.call.head_targets,
        bias=bias,
        temperature=context.settings.temperature,
        softcap=spec.softcap,
        return_entropy=context.settings.return_entropy,
        chunk_size=HEAD_CHUNK_ROWS,
        ignore_index=None,  # every head pair is scored
        keep_logits_bytes=context.keep_logits_bytes,
        weight_grad=None if grads is None or not torch.is_grad_enabled() else grads.buffer(weight),
    )
    results = results if context.settings.return_entropy else (results,)
    context.route = RouteBox()
    # The log-probs leave on the head's output (and so on the model's), where wrappers see their gradient arrive.
    return attach(hidden_states[..., :0], context.route, *results)


def fused_logits(lm_head: nn.Module, spec, hidden: torch.Tensor) -> torch.Tensor:
    """Full float32 logits ``softcap(scale * hidden @ W.T + b)`` as the fused head computes them, with ``W, b`` the
    head's effective weight and bias (for checks on a few rows, not for training; call inside the forward)."""
    weight, bias = effective_head(lm_head)
    hidden = hidden * spec.scale if spec.scale != 1.0 else hidden
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    return logits

"""The head check: the fused head must reproduce the model's own logits, checked inside one ordinary forward of
the outermost module (where sharded wrappers hold full weights), per model instance and again whenever anything
its verdict depends on changes (:func:`head_signature`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..forward.context import CONTEXT_KWARG, CallSettings, ContextHandle, HeadCheckContext, NodeContext, activated
from ..forward.head_weights import UnsupportedHeadError, head_state
from ..forward.node_call import single_node_call


def head_signature(prepared) -> tuple:
    """What the head check's verdict depends on: the head module and its PEFT state, the hooks that could change
    logits on their way out (on the head, the causal LM and the outer module, and global ones), and the logit
    settings read from the config. A model deep-copied after use has new modules, hence a new signature.

    The outer module counts by its class and its hooks (handle ids, unique within the process), not by its identity: a
    caller may wrap the model anew for each call (the trainer plug-ins' autocast wrapper), and the ``id()`` of such a
    wrapper is whatever address it was allocated at, reused from a dead wrapper or not. Keyed on it, the check ran
    again on some calls and not on others, differently on each process; under FSDP the check's forward is a
    collective, and one process's extra forward put the processes' model calls out of step."""
    from torch.nn.modules import module as module_globals

    spec = prepared.head
    lm_head = spec.lm_head
    hooks = tuple(tuple(module._forward_hooks) for module in (lm_head, prepared.causal_lm, prepared.outer))
    # Only forward (post) hooks can change logits behind the fused head's back: a pre-hook changes inputs, which the
    # fused head then receives as the module would.
    global_hooks = tuple(module_globals._global_forward_hooks)
    return (id(lm_head), head_state(lm_head), type(prepared.outer), hooks, global_hooks, spec.scale, spec.softcap)


def _gathered_outside_engine(module: nn.Module):
    """ZeRO-3 parameters partitioned outside an engine (``deepspeed.zero.Init``, as transformers loads a model under
    a ZeRO-3 config, before ``deepspeed.initialize`` installs the hooks that gather them in each forward) are empty
    tensors: gather them for the block (a collective, as the engine's own forward would be). A module an engine has
    registered (its modules carry ``ds_id``) gathers its parameters itself."""
    params = [param for param in module.parameters() if hasattr(param, "ds_id")]
    if not params or hasattr(module, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def verify_head(prepared) -> None:
    """Compare the fused head's logits with the model's own on a few tokens, inside one ordinary forward of the
    outermost module; raise if they differ."""
    name = type(prepared.causal_lm).__name__
    check = HeadCheckContext(spec=prepared.head)
    ids = torch.arange(1, min(prepared.input_vocab_size, 5), device=prepared.device)[None]
    # The layers attend through the shared-prefix attention (a call of one node), so the check does not depend on the
    # model's own implementation being runnable here (a flash-attention name on a CPU tensor, say).
    call = single_node_call(ids)
    positions = call.positions
    attend = NodeContext(call=call, sources=[], settings=CallSettings(), needs_grad=False, head_spec=prepared.head)
    try:
        with torch.no_grad(), _gathered_outside_engine(prepared.causal_lm), activated(check):
            output = prepared.outer(
                input_ids=ids, position_ids=positions, use_cache=False, **{CONTEXT_KWARG: ContextHandle(attend)}
            )
        logits = output.logits.float()
    except UnsupportedHeadError as error:
        raise UnsupportedModelError(f"{name}: {error}") from None
    if check.calls != 1:
        raise UnsupportedModelError(f"{name} called its lm_head {check.calls} times in one forward")
    ours = check.fused_logits
    if ours.shape != logits.shape:
        raise UnsupportedModelError(
            f"{name}: logits of shape {tuple(logits.shape)} do not come from the lm_head alone "
            f"(head gives {tuple(ours.shape)})"
        )
    weight_dtype = prepared.head.lm_head.weight.dtype
    tolerance = 1e-4 if weight_dtype in (torch.float32, torch.float64) else 2e-2
    error = (ours - logits).abs().max().item()
    if not error <= tolerance * max(1.0, logits.abs().max().item()):
        raise UnsupportedModelError(
            f"{name} post-processes its logits in a way the fused head does not reproduce (max |difference| "
            f"{error:.3g}: a config logit setting its class ignores, a hook on the head or the model, or a head "
            "wrapper); refusing to compute log-probs that could be wrong"
        )

"""Which of SDPA's kernels the expand backend's fused-kernel path runs a call on, and whether that kernel needs the
grouped-query KV heads repeated.

torch picks a kernel per call: it walks its priority order and takes the first enabled kernel whose checks accept
the call. Three of its rules shape what the library does instead of fixing an order of its own:

- The order is torch's own. torch fills in its default lazily, in the first SDPA call of the process on CUDA (cuDNN
  first on sm90/sm100 with a recent cuDNN). A first call made inside ``sdpa_kernel(..., set_priority=True)`` has that
  initialization overwritten when the context restores the order it read before it, and the process loses torch's
  default for good. So the library never sets a priority: once per device it makes one small SDPA call outside any
  context (torch's initialization, if it has not happened yet) and reads the order (:func:`torch_priority`).
- Which kernels accept a call depends on the call (mask or not, grouped heads, dtype, head size, gradients, torch
  version): torch 2.11's memory-efficient kernel rejects grouped-query heads, newer ones take them, flash takes no
  mask, cuDNN takes 4-D additive masks and grouped heads. Each fused kernel in torch's order that the user has not
  disabled is asked (``torch.backends.cuda.can_use_*``) whether it accepts the call as it is, grouped heads native
  (``enable_gqa``), and otherwise, for grouped heads, whether it accepts them repeated; the first that does is
  chosen (:func:`choose`).
  The math kernel, which materializes the scores, is taken where torch's order puts it: last on sm90 with a recent
  cuDNN, but before cuDNN in torch's default order (torch keeps cuDNN last there on purpose: older cuDNN versions
  mishandled some sequence lengths), so a call the fused kernels ahead of it reject runs on math, as torch would run
  it, not on cuDNN. Decisions are cached per call signature (device, dtypes, shapes, strides, mask layout, causal
  flag, gradients), which every layer of a node call shares.
- The call runs inside ``sdpa_kernel([chosen])`` (:func:`run_on`): only the kernels' enabled flags change, and they
  are restored on exit; torch's priority order is left as torch keeps it.

cuDNN builds an execution graph per call signature (shapes, strides, mask shape), forward and backward, and expand's
scoring batches and tree node calls change shape every step. Bucketing the lengths cuDNN sees, or preferring the
memory-efficient kernel where shapes vary, waits for a GPU measurement of those builds; until then torch's choice
stands (docs/how-it-works.md, expand).

A bfloat16 result is judged against a float32 truth with the dense bfloat16 path's own error as the yardstick. On
sm90 the dense path (the model's own SDPA attention) and the expand backend's masked calls may both run on cuDNN, so a
cuDNN defect would inflate both errors alike and pass unseen (pytorch#193893: grouped-query results corrupted by
cuDNN on sm100). :func:`excluded` runs the yardstick off the judged kernel: ``with excluded("CUDNN_ATTENTION"): ...``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The fused kernels (``SDPBackend`` names) the library asks, in torch's priority order.
FUSED_KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")

#: Kernels the library may choose; the math kernel (scores materialized) comes after every fused one. Tests remove
#: "MATH" to check that a fused kernel takes every call.
ALLOWED_KERNELS = (*FUSED_KERNELS, "MATH")

# torch's ``can_use_*`` check of each fused kernel, and the flag that says whether the user enabled it.
_CHECKS = {
    "CUDNN_ATTENTION": "can_use_cudnn_attention",
    "FLASH_ATTENTION": "can_use_flash_attention",
    "EFFICIENT_ATTENTION": "can_use_efficient_attention",
}
_ENABLED_FLAGS = {
    "CUDNN_ATTENTION": "cudnn_sdp_enabled",
    "FLASH_ATTENTION": "flash_sdp_enabled",
    "EFFICIENT_ATTENTION": "mem_efficient_sdp_enabled",
    "MATH": "math_sdp_enabled",
}
# torch's order before it is initialized, for a torch without ``_get_sdp_priority_order`` (the default that
# ``torch._C._get_sdp_priority_order()`` returns off sm90 in torch 2.11 and 2.13: math before cuDNN).
_DEFAULT_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")
# Decisions cached at most; the cache is cleared when full (shapes vary between scoring batches).
_MAX_CACHED = 1024

_PRIORITY: dict[tuple, tuple[str, ...]] = {}
_CHOICES: dict[tuple, KernelChoice] = {}


@dataclass(frozen=True)
class KernelChoice:
    """The SDPA kernel a call runs on.

    Attributes:
        kernel: an ``SDPBackend`` name: one of :data:`FUSED_KERNELS` or "MATH".
        repeat_kv: whether the KV heads must be repeated to the query heads first (the kernel rejects grouped heads).
    """

    kernel: str
    repeat_kv: bool


def choose(query, key, value, mask, *, dropout: float, is_causal: bool) -> KernelChoice:
    """The kernel for ``F.scaled_dot_product_attention(query, key, value, attn_mask=mask, ...)`` (see the module
    docstring), cached per call signature.

    Args:
        query: (batch, heads, q_len, head_dim); key/value: (batch, kv_heads, k_len, head_dim / v_head_dim).
        mask: None or an additive/boolean mask broadcastable to (batch, heads, q_len, k_len).
    Raises:
        RuntimeError: no allowed and enabled kernel accepts the call.
    """
    signature = _signature(query, key, value, mask, dropout, is_causal)
    choice = _CHOICES.get(signature)
    if choice is None:
        choice = _decide(query, key, value, mask, dropout, is_causal)
        if len(_CHOICES) >= _MAX_CACHED:
            _CHOICES.clear()
        _CHOICES[signature] = choice
    return choice


def _decide(query, key, value, mask, dropout, is_causal) -> KernelChoice:
    heads = query.shape[1]
    grouped = key.shape[1] != heads
    for kernel in torch_priority(query.device):
        if kernel not in ALLOWED_KERNELS or not enabled(kernel):
            continue
        if kernel == "MATH":
            # Where torch's order puts math before a fused kernel (cuDNN, in its default order), torch would run the
            # call on math: so does the library.
            return KernelChoice("MATH", repeat_kv=False)
        if kernel not in FUSED_KERNELS:
            continue
        if accepts(kernel, query, key, value, mask, dropout, is_causal, grouped):
            return KernelChoice(kernel, repeat_kv=False)
        if grouped:
            # Views shaped like the repeated heads: the checks read shapes, strides and dtypes, not the values.
            repeated_key = key[:, :1].expand(-1, heads, -1, -1)
            repeated_value = value[:, :1].expand(-1, heads, -1, -1)
            if accepts(kernel, query, repeated_key, repeated_value, mask, dropout, is_causal, False):
                return KernelChoice(kernel, repeat_kv=True)
    if "MATH" in ALLOWED_KERNELS and enabled("MATH"):
        return KernelChoice("MATH", repeat_kv=False)
    raise RuntimeError(
        f"no enabled SDPA kernel among {ALLOWED_KERNELS} accepts this attention call (query {tuple(query.shape)} "
        f"{query.dtype}, key {tuple(key.shape)}, mask {None if mask is None else tuple(mask.shape)}, is_causal="
        f"{is_causal}); enable the math kernel (torch.backends.cuda.enable_math_sdp(True)) or use backend='flex'"
    )


def accepts(kernel: str, query, key, value, mask, dropout: float, is_causal: bool, enable_gqa: bool) -> bool:
    """Whether torch's ``kernel`` (a name in :data:`FUSED_KERNELS`) takes the call, per its ``can_use_*`` check.

    False off CUDA (the checks need a CUDA build and device), for a check this torch lacks, and for native grouped
    heads on a torch whose ``SDPAParams`` has no ``enable_gqa``.
    """
    check = getattr(torch.backends.cuda, _CHECKS[kernel], None)
    if query.device.type != "cuda" or check is None:
        return False
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, mask, dropout, is_causal, enable_gqa)
    except TypeError:  # a torch without enable_gqa in SDPAParams
        if enable_gqa:
            return False
        params = torch.backends.cuda.SDPAParams(query, key, value, mask, dropout, is_causal)
    return bool(check(params))


def enabled(kernel: str) -> bool:
    """Whether the user left ``kernel`` enabled (``torch.backends.cuda.enable_*_sdp``)."""
    flag = getattr(torch.backends.cuda, _ENABLED_FLAGS[kernel], None)
    return flag is None or bool(flag())


def torch_priority(device: torch.device) -> tuple[str, ...]:
    """torch's SDPA priority order (``SDPBackend`` names, most preferred first) once torch has initialized it on
    ``device``'s kind of device; read once per device."""
    slot = (device.type, device.index)
    if slot not in _PRIORITY:
        _let_torch_initialize_its_order(device)
        read = getattr(torch._C, "_get_sdp_priority_order", None)
        if read is None:
            _PRIORITY[slot] = _DEFAULT_ORDER
        else:
            from torch.nn.attention import SDPBackend

            names = {int(getattr(SDPBackend, name)): name for name in ALLOWED_KERNELS if hasattr(SDPBackend, name)}
            _PRIORITY[slot] = tuple(names[int(b)] for b in read() if int(b) in names)
    return _PRIORITY[slot]


def _let_torch_initialize_its_order(device: torch.device) -> None:
    # One tiny call outside any sdpa_kernel context: torch sets its default order in the first call of the process.
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    with torch.no_grad():
        probe = torch.zeros(1, 1, 16, 64, dtype=dtype, device=device)
        F.scaled_dot_product_attention(probe, probe, probe)


@contextlib.contextmanager
def excluded(*kernels: str):
    """Within the context SDPA may not use ``kernels`` (``SDPBackend`` names, e.g. "CUDNN_ATTENTION"): every other
    kernel keeps its enabled flag, the flags are restored on exit and torch's priority order is not touched.

    For a reference that must not share a kernel with the path it judges: the dense bfloat16 yardstick of the GPU
    tests runs under ``excluded("CUDNN_ATTENTION")`` (see the module docstring). The expand backend's own choice
    inside the context also skips the excluded kernels (it reads the enabled flags).

    Raises:
        ValueError: a name that is not one of :data:`ALLOWED_KERNELS`' kernels, or nothing left enabled.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    unknown = [name for name in kernels if name not in _ENABLED_FLAGS]
    if unknown:
        raise ValueError(f"excluded() takes SDPBackend names among {tuple(_ENABLED_FLAGS)}, got {unknown}")
    keep = [getattr(SDPBackend, name) for name in _ENABLED_FLAGS if name not in kernels and enabled(name)]
    if not keep:
        raise ValueError(f"excluding {kernels} leaves no SDPA kernel enabled")
    with sdpa_kernel(keep):
        yield


@contextlib.contextmanager
def run_on(choice: KernelChoice):
    """Within the context, SDPA may use ``choice.kernel`` only: its enabled flags are set and restored on exit;
    the priority order is not touched (no ``set_priority``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, choice.kernel)]):
        yield


def clear_cache() -> None:
    """Forget the priority orders read and the choices made (tests that change torch's rules call this)."""
    _PRIORITY.clear()
    _CHOICES.clear()


def _signature(query, key, value, mask, dropout, is_causal) -> tuple:
    """Everything the kernels' checks read, except values: shapes, strides, dtypes, 16-element storage offsets,
    gradient requirements, the mask's layout, the dropout, the causal flag and the enabled flags."""

    def layout(tensor):
        if tensor is None:
            return None
        return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset() % 16, tensor.requires_grad)

    return (
        query.device,
        layout(query),
        layout(key),
        layout(value),
        layout(mask),
        float(dropout),
        bool(is_causal),
        torch.is_grad_enabled(),
        tuple(enabled(kernel) for kernel in ALLOWED_KERNELS),
        ALLOWED_KERNELS,
    )

"""A stand-in for ``F.scaled_dot_product_attention`` that records what every call receives."""

from __future__ import annotations

import torch

#: torch's getter of each SDPA kernel's enabled flag, by ``SDPBackend`` name.
ENABLED_GETTERS = {
    "CUDNN_ATTENTION": "_get_cudnn_sdp_enabled",
    "FLASH_ATTENTION": "_get_flash_sdp_enabled",
    "EFFICIENT_ATTENTION": "_get_mem_efficient_sdp_enabled",
    "MATH": "_get_math_sdp_enabled",
}


def enabled_kernels() -> tuple[str, ...]:
    """Names of the SDPA kernels enabled now (inside an ``sdpa_kernel`` context: the ones it allows)."""
    return tuple(name for name, getter in ENABLED_GETTERS.items() if getattr(torch._C, getter)())


class SdpaCalls:
    """Records each call's mask, causal flag, key length and head layout, and the kernels enabled during it, then
    runs ``sdpa`` (the real function, or a fake standing in for CUDA's kernel selection)."""

    def __init__(self, sdpa):
        self.sdpa = sdpa
        self.calls = []

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        self.calls.append(
            dict(
                mask=attn_mask,
                is_causal=kwargs.get("is_causal", False),
                key_len=key.shape[2],
                head_dim=query.shape[-1],
                same_heads=key.shape[1] == query.shape[1],
                gqa=kwargs.get("enable_gqa", False),
                enabled=enabled_kernels(),
            )
        )
        return self.sdpa(query, key, value, attn_mask=attn_mask, **kwargs)


def aligned_rows(mask: torch.Tensor) -> bool:
    """Whether every stride of ``mask`` but the last is a multiple of 16 elements (SDPA's kernels take it without a
    padded copy) and its rows are contiguous."""
    return mask.stride(-1) == 1 and all(stride % 16 == 0 for stride in mask.stride()[:-1])

"""The ``kernel_options`` the flex backend passes to ``flex_attention`` where inductor compiles it (CUDA).

Two of inductor's rules for its Triton flex kernel cost the backend on CUDA unless it says what it knows. Both read
from torch 2.11 (the GPU image) and torch 2.13: ``torch/_inductor/kernel/flex/flex_attention.py`` (the lowering) and
``torch/_inductor/template_heuristics/triton.py`` (``CUDAConfigHeuristic``).

- **IS_DIVISIBLE.** The lowering sets ``IS_DIVISIBLE`` (no bounds check on any tile) only when it can prove both
  sequence lengths multiples of 128 (2.13: ``statically_known_true(Eq(Mod(seq_len, 128), 0))``; 2.11:
  ``seq_len % 128 != 0`` on the symbolic length). The backend compiles with dynamic lengths, which prove nothing, so
  every tile would be bounds-checked, although every length the backend hands to the kernel is padded to whole
  128-token blocks (``flex.padded_length``) and every block size the kernel uses divides 128. The lowering only
  ``setdefault``\\ s it, in the forward and the backward (and flex decoding), so the option given here wins.
- **Forward block sizes.** Without max-autotune the lowering compiles one configuration per (GPU, dtype, head dim)
  from a table, and a head dim the table lacks gets a generic default (64 x 64 blocks, 3 stages, 4 warps), tuned for
  nothing in particular. The kernel rounds the query/key head dim up to a power of two (``QK_HEAD_DIM_ROUNDED``), so a
  head dim of 192 (MLA: DeepSeek-V3's 128 + 64) computes with 256-wide tiles under a configuration sized for neither:
  on sm90 the 2.11 and 2.13 tables have no 192 entry for bfloat16 (2.11 none for float32 either), and the default's
  three stages of 64 x 256 key and value tiles exceed the shared memory an H100 block can take, which fails the first
  compilation, while 128 and 256 (Gemma-2) have entries and compile. Where the table has no entry for a head dim that
  rounds up past 128, the backend passes the configuration the same table gives the rounded head dim (the same tile
  shapes inside the kernel, a size torch tunes and ships for this GPU and dtype) as ``fwd_`` options. Entries torch
  has are kept; the backward table has no per-size gaps above 128 on sm90 (one configuration for 129..256).

Which options a call gets is a function of its device's capability, dtype and head dim (one per compiled
configuration, so they add no compilations). Torch versions without the heuristics class get IS_DIVISIBLE only.
"""

from __future__ import annotations

import functools

import torch

#: Device types whose flex_attention inductor compiles into Triton kernels, where the options apply. Tests add "cpu"
#: to see the options a CUDA call would get.
DEVICES = {"cuda"}

#: Head dims rounded up to a power of two above this are checked for a missing table entry: the shared memory the
#: generic default needs at 256-wide tiles is what fails; below it the default fits.
ROUNDED_ABOVE = 128


def kernel_options(device: torch.device, dtype: torch.dtype, qk_head_dim: int) -> dict | None:
    """The ``kernel_options`` of a flex_attention call on ``device`` with queries/keys of ``dtype`` and head dim
    ``qk_head_dim`` (after any widening to the kernel's minimum); None where flex is not compiled into Triton kernels.
    """
    if device.type not in DEVICES:
        return None
    options = {"IS_DIVISIBLE": True}  # every length is padded to whole 128-token blocks
    options.update(forward_blocks(_capability(device), dtype, qk_head_dim))
    return options


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.type == "cuda" else None
    return tuple(torch.cuda.get_device_capability(index))


@functools.cache
def forward_blocks(capability: tuple[int, int], dtype: torch.dtype, qk_head_dim: int) -> dict:
    """``fwd_BLOCK_M``/``fwd_BLOCK_N``/``fwd_num_stages``/``fwd_num_warps`` for a head dim torch's table lacks on a GPU
    of ``capability`` (see the module docstring); empty where torch's own choice is kept."""
    rounded = 1 << max(qk_head_dim - 1, 0).bit_length()
    if rounded == qk_head_dim or not ROUNDED_ABOVE < rounded <= 256:
        return {}
    absent = qk_head_dim - 1 if qk_head_dim % 2 == 0 else qk_head_dim - 2  # odd: in no table
    own, generic, tuned = (_torch_forward_config(capability, dtype, d) for d in (qk_head_dim, absent, rounded))
    if own is None or own != generic or tuned is None or tuned == own:
        return {}  # torch has an entry for this head dim (or no table to read): its choice stands
    return {
        "fwd_BLOCK_M": tuned.block_m,
        "fwd_BLOCK_N": tuned.block_n,
        "fwd_num_stages": tuned.num_stages,
        "fwd_num_warps": tuned.num_warps,
    }


def _torch_forward_config(capability: tuple[int, int], dtype: torch.dtype, head_dim: int):
    """The forward configuration torch's CUDA heuristics pick without max-autotune on a GPU of ``capability``, or None
    where this torch has no such class."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
    except ImportError:
        return None
    heuristic = CUDAConfigHeuristic()
    if not hasattr(heuristic, "get_flex_attn_fwd_configs"):
        return None
    read = torch.cuda.get_device_capability
    try:
        torch.cuda.get_device_capability = lambda *args, **kwargs: capability  # the heuristics read the current GPU
        with inductor_config.patch(max_autotune=False):
            configs = heuristic.get_flex_attn_fwd_configs(head_dim, dtype)
    finally:
        torch.cuda.get_device_capability = read
    return configs[-1] if configs else None

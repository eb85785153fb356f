"""CUDA checks of the expand backend's kernel rules (marked ``gpu``, skipped without a CUDA device): the premise of
the row-aligned masks (SDPA's memory-efficient kernel copies an unaligned mask in every call), the kernel chosen
by torch's own checks with torch's priority order left as torch initializes it, and exactness of unpadded prompts
(the causal prompts' call without a mask) against dense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import expand

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def _peak_of_efficient_call(query, key, value, mask) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_aligned_mask_is_not_copied_by_the_efficient_kernel():
    rows, heads, queries, keys, dim = 8, 4, 256, 1023, 64  # keys 7 mod 8, as P - 1 + C for P, C multiples of 8
    query = torch.randn(rows, heads, queries, dim, device=CUDA, dtype=torch.bfloat16)
    key = torch.randn(rows, heads, keys, dim, device=CUDA, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    allowed = torch.rand(rows, 1, queries, keys, device=CUDA) < 0.9
    plain = torch.zeros(rows, 1, queries, keys, device=CUDA, dtype=torch.bfloat16).masked_fill_(~allowed, -1e4)
    aligned = expand.additive_mask(allowed, torch.bfloat16)
    mask_bytes = plain.numel() * plain.element_size()
    # The unaligned mask costs a padded copy of itself on top of what the kernel allocates for either.
    copied = _peak_of_efficient_call(query, key, value, plain) - _peak_of_efficient_call(query, key, value, aligned)
    assert copied >= 0.9 * mask_bytes, (copied, mask_bytes)


_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, "tests")
    from support.tiny_models import build_model, make_batch
    from shared_prefix_logps import compute_logps
    from shared_prefix_logps.backends import sdpa_kernels

    mode = sys.argv[1]
    if mode == "plain":  # what torch's order becomes after an ordinary first SDPA call
        q = torch.zeros(1, 1, 16, 64, device="cuda", dtype=torch.float16)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        print(json.dumps({"order": [int(b) for b in torch._C._get_sdp_priority_order()]}))
        sys.exit(0)
    model = build_model("llama", dtype=torch.bfloat16).cuda()  # 4 query heads over 2 KV heads
    # Eager attention: the library's call is the process's first SDPA call, the one where torch sets its order.
    model.set_attn_implementation("eager")
    prompts, pmask, comps, cmask = (t.cuda() for t in make_batch(2, 3, 32, 16))
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")
    out.logps.sum().backward()
    choices = sorted({(c.kernel, c.repeat_kv) for c in sdpa_kernels._CHOICES.values()})
    print(json.dumps({"order": [int(b) for b in torch._C._get_sdp_priority_order()], "choices": choices}))
    """
)


def _fresh(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, mode], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_library_calls_keep_torchs_priority_order_and_use_fused_kernels():
    plain, ours = _fresh("plain"), _fresh("library")
    # The order torch initializes in a process's first SDPA call (cuDNN first on sm90) survives the library's calls.
    assert ours["order"] == plain["order"], (ours, plain)
    kernels = {kernel for kernel, _ in ours["choices"]}
    assert kernels and "MATH" not in kernels, ours["choices"]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_unpadded_prompts_match_dense_on_cuda(family):
    model = build_model(family).to(CUDA)
    _, _, comps, cmask = make_batch(2, 3, 32, 16, seed=2)
    prompts = torch.randint(1, 101, (2, 32), generator=torch.Generator().manual_seed(2))
    args = [t.to(CUDA) for t in (prompts, comps)]
    kwargs = dict(prompt_mask=torch.ones_like(args[0], dtype=torch.bool), completion_mask=cmask.to(CUDA))
    ours = compute_logps(model, *args, backend="expand", **kwargs)
    dense = compute_logps(model, *args, backend="dense", **kwargs)
    assert (ours.logps - dense.logps).abs().max() <= 1e-4
    grads = parameter_grads(model, weighted_loss(ours))
    assert max_relative_grad_error(grads, parameter_grads(model, weighted_loss(dense))) <= 1e-3

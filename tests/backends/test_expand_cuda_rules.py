"""CUDA's SDPA rules, checked on CPU on the expand backend's fused-kernel path (the branch it takes on CUDA, selected
here for "cpu"):

- every additive mask handed to SDPA has rows that start every 16 elements (the memory-efficient kernel copies a
  mask whose strides are not multiples of 8 in every call, and saves the copy for backward);
- a node call without ancestors or window (the prompts') runs with ``is_causal=True`` and no mask (kernels skip the key
  tiles above the diagonal), and a call whose nodes have as many ancestor tokens (completions of unpadded prompts)
  shares one mask row among its nodes;
- the kernel is the first in torch's own priority order whose checks accept the call, KV heads are repeated only for a
  kernel that rejects grouped heads, and torch's priority order (which torch initializes in the first SDPA call of a
  process, cuDNN first on sm90) is left as torch set it. A fake SDPA stands in for CUDA's kernel selection, with the
  acceptance rules of torch 2.11 on sm80 and of torch 2.13 on sm90;
- softcap/sinks attention, whose scores are explicit, is refused above a memory budget, with its size named;
and the results stay exact against dense (log-probs and every parameter's gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads, weighted_loss
from support.sdpa_spy import SdpaCalls, aligned_rows, enabled_kernels
from support.tiny_models import build_model, make_batch
from support.trees import pad_rows, random_tree_rows
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared_prefix_logps import compute_logps, compute_logps_tree
from shared_prefix_logps.backends import expand, expand_memory, sdpa_kernels

HEAD_DIM = 8  # the tiny models' head size; the priority probe's own call has 64


def unpadded_batch(num_prompts, generations, prompt_len, completion_len, seed=0):
    """Prompts without padding (completions right-padded as in make_batch)."""
    _, _, comps, cmask = make_batch(num_prompts, generations, prompt_len, completion_len, seed=seed)
    prompts = torch.randint(1, 101, (num_prompts, prompt_len), generator=torch.Generator().manual_seed(seed))
    return prompts, torch.ones_like(prompts, dtype=torch.bool), comps, cmask


def library_calls(spy):
    return [call for call in spy.calls if call["head_dim"] == HEAD_DIM]


def run_with_spy(monkeypatch, family, batch, sdpa=None):
    spy = SdpaCalls(sdpa or torch.nn.functional.scaled_dot_product_attention)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build_model(family, layers=2)
    prompts, pmask, comps, cmask = batch
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")
    out.logps.sum().backward()
    return library_calls(spy)


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize(
    "family, padded",
    [("llama", True), ("llama", False), ("mistral", False), ("mistral", True)],
)
def test_every_mask_handed_to_sdpa_has_aligned_rows(family, padded, monkeypatch):
    # The completions' call attends over the prompts (P = 16) and its own tokens (C = 7): 23 keys, 7 mod 8.
    maker = make_batch if padded else unpadded_batch
    calls = run_with_spy(monkeypatch, family, maker(2, 3, 16, 7))
    masks = [call["mask"] for call in calls if call["mask"] is not None]
    assert masks  # the completions' call always has one; Mistral's window (6 keys) needs one for the prompts too
    assert any(mask.shape[-1] == 23 for mask in masks)
    for mask in masks:
        assert aligned_rows(mask), (tuple(mask.shape), mask.stride())


@pytest.mark.usefixtures("fused_path_on_cpu")
def test_prompts_run_causal_without_mask_and_completions_share_one_mask_row(monkeypatch):
    layers = 2
    calls = run_with_spy(monkeypatch, "llama", unpadded_batch(2, 3, 16, 8))
    prompts = [call for call in calls if call["key_len"] == 16]
    completions = [call for call in calls if call["key_len"] == 24]
    # The completions' call runs again in backward (its gathered keys recomputed on the fused path).
    assert len(prompts) == layers and len(completions) == 2 * layers
    assert all(call["mask"] is None and call["is_causal"] for call in prompts)
    # The completions' call: one (1, 1, C, P + C) mask row for every completion (not 5 copies), broadcast by SDPA.
    mask = completions[0]["mask"]
    assert mask.shape == (1, 1, 8, 24) and not completions[0]["is_causal"]
    # Left-padded prompts of different lengths are rows padded after their tokens in the prompts' call, which
    # causality hides: no mask there either; their completions have ancestors of different lengths: a mask per node.
    padded = run_with_spy(monkeypatch, "llama", make_batch(2, 3, 16, 8))
    assert all(call["mask"] is None and call["is_causal"] for call in padded if call["key_len"] == 16)
    assert all(call["mask"].shape[0] > 1 for call in padded if call["key_len"] == 24)


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("prompt_len", [16, 1])
def test_unpadded_prompts_on_fused_path_match_dense(family, prompt_len):
    # prompt_len 1: each completion attends over a one-token prompt.
    model = build_model(family)
    prompts, pmask, comps, cmask = unpadded_batch(2, 3, prompt_len, 8, seed=5)
    errors = compare_with_dense(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True
    )
    assert errors[0] <= 1e-5 and errors[1] <= 1e-5 and errors[2] <= 1e-4, errors


# ---- prefix trees ---------------------------------------------------------------------------------------------------


def spied_tree_pass(monkeypatch, model, ids, mask, score, sdpa=None, **options):
    """Calls of the library's tree entry point (forward with gradients, then backward) to SDPA, and the output;
    ``options`` go to ``compute_logps_tree``."""
    spy = SdpaCalls(sdpa or torch.nn.functional.scaled_dot_product_attention)
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        out = compute_logps_tree(model, ids, mask, score, return_entropy=True, **options)
        out.logps.sum().backward()
    model.zero_grad(set_to_none=True)
    return [call for call in spy.calls if call["head_dim"] == HEAD_DIM]


def shared_prompt_rows(prompt_len: int, suffixes: list[int], seed: int = 0):
    """(ids, mask, score): rows of one shared ``prompt_len``-token prompt and suffixes of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 101, (prompt_len,), generator=gen).tolist()
    rows = [system + torch.randint(0, 101, (n,), generator=gen).tolist() for n in suffixes]
    return pad_rows(rows, seed, hole_rate=0.0)


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])  # gemma2's softcap: explicit scores, no SDPA
def test_every_tree_mask_handed_to_sdpa_has_aligned_rows_and_results_are_exact(family, monkeypatch):
    model = build_model(family, layers=2)
    ids, mask, score = pad_rows(random_tree_rows(3, depth=3, branching=3, max_segment=6), 3)
    # Unmerged: the tiny-node rule would merge this trie's short nodes into a forest of top-level nodes (no mask).
    calls = spied_tree_pass(monkeypatch, model, ids, mask, score, merge_tiny_nodes=False)
    masks = [call["mask"] for call in calls if call["mask"] is not None]
    assert masks and any(m.shape[-1] % 16 for m in masks), [tuple(m.shape) for m in masks]
    for m in masks:
        assert aligned_rows(m), (tuple(m.shape), m.stride())
    # Every call on the fused path ran inside the kernel choice's context (off CUDA torch's checks accept no fused
    # kernel, so the choice is the math kernel alone).
    assert all(call["enabled"] == ("MATH",) for call in calls)
    tree = compute_logps_tree(model, ids, mask, score, return_entropy=True)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() <= 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() <= 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err <= 1e-4


@pytest.mark.usefixtures("fused_path_on_cpu")
def test_root_call_of_a_shared_prompt_runs_causal_without_mask(monkeypatch):
    layers = 2
    model = build_model("llama", layers=layers)
    # Unmerged: the 12-token prompt saves 24 tokens, fewer than the tiny-node rule's threshold, and would be merged.
    calls = spied_tree_pass(monkeypatch, model, *shared_prompt_rows(12, [3, 5, 4]), merge_tiny_nodes=False)
    root = [call for call in calls if call["key_len"] == 12]
    children = [call for call in calls if call["key_len"] == 12 + 5]  # ancestors + the longest child
    # The children's gather is recomputed in backward; the root call gathers nothing and runs once.
    assert len(root) == layers and len(children) == 2 * layers
    assert all(call["mask"] is None and call["is_causal"] for call in root)
    assert all(call["mask"] is not None and not call["is_causal"] for call in children)
    # Top-level nodes of different lengths are rows padded after their tokens, which causality hides from them: causal
    # SDPA without a mask too.
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (6, 9)]
    calls = spied_tree_pass(monkeypatch, model, *pad_rows(rows, 1, hole_rate=0.0))
    assert calls and all(call["mask"] is None and call["is_causal"] for call in calls)


def _torch_2_11_sm80(kernel, query, key, value, mask, dropout, is_causal, enable_gqa):
    """torch 2.11 on sm80: flash takes no mask (grouped heads natively), the memory-efficient kernel no grouped
    heads, cuDNN nothing."""
    grouped = key.shape[1] != query.shape[1]
    if kernel == "FLASH_ATTENTION":
        return mask is None and (not grouped or enable_gqa)
    return kernel == "EFFICIENT_ATTENTION" and not grouped


_REAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def _math_on_cpu(query, key, value, attn_mask=None, **kwargs):
    # The numbers come from torch's CPU math kernel, whatever the emulated choice enabled.
    with sdpa_kernel([SDPBackend.MATH]):
        return _REAL_SDPA(query, key, value, attn_mask=attn_mask, **kwargs)


@pytest.mark.usefixtures("fused_path_on_cpu")
def test_tree_kernel_choice_goes_through_torchs_checks_and_repeats_heads_only_when_needed(monkeypatch):
    monkeypatch.setattr(sdpa_kernels, "accepts", _torch_2_11_sm80)
    model = build_model("llama", layers=2)  # 4 query heads over 2 KV heads
    ids, mask, score = shared_prompt_rows(12, [3, 5, 4], seed=2)
    # Unmerged (the tiny-node rule would merge the 12-token prompt into its children: no masked call).
    calls = spied_tree_pass(monkeypatch, model, ids, mask, score, sdpa=_math_on_cpu, merge_tiny_nodes=False)
    root = [call for call in calls if call["mask"] is None]
    masked = [call for call in calls if call["mask"] is not None]
    assert root and masked
    assert all(call["enabled"] == ("FLASH_ATTENTION",) and call["gqa"] and not call["same_heads"] for call in root)
    assert all(call["enabled"] == ("EFFICIENT_ATTENTION",) and call["same_heads"] for call in masked)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _math_on_cpu)
    tree = compute_logps_tree(model, ids, mask, score)
    dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() <= 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err <= 1e-4


# ---- kernel choice under CUDA's rules, emulated ---------------------------------------------------------------------

_CODES = {"MATH": 0, "FLASH_ATTENTION": 1, "EFFICIENT_ATTENTION": 2, "CUDNN_ATTENTION": 3, "OVERRIDEABLE": 4}
_NAMES = {code: name for name, code in _CODES.items()}


def _grouped(query, key, enable_gqa):
    return key.shape[1] != query.shape[1]


def _flash(query, key, value, mask, is_causal, enable_gqa):
    # No mask; a causal call only with as many queries as keys; grouped heads natively.
    return mask is None and (not is_causal or query.shape[2] == key.shape[2])


def _efficient_2_11(query, key, value, mask, is_causal, enable_gqa):
    return not _grouped(query, key, enable_gqa)  # torch 2.11: no grouped-query heads


def _anything(query, key, value, mask, is_causal, enable_gqa):
    return True


def _nothing(query, key, value, mask, is_causal, enable_gqa):
    return False


@dataclass
class FakeCudaTorch:
    """CUDA's SDPA kernel selection, emulated: per-kernel acceptance rules, the priority order torch starts with and
    the one it sets in its first SDPA call of the process."""

    rules: dict
    initial_order: tuple = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION", "OVERRIDEABLE")
    first_call_order: tuple | None = None
    real_sdpa: object = None
    initialized: bool = False
    kernels: list = field(default_factory=list)

    def accepts(self, kernel, query, key, value, mask, dropout, is_causal, enable_gqa):
        if _grouped(query, key, enable_gqa) and not enable_gqa:
            return False
        return self.rules[kernel](query, key, value, mask, is_causal, enable_gqa)

    def __call__(self, query, key, value, attn_mask=None, **kwargs):
        if not self.initialized:  # what torch's priority_order() does in its first call
            self.initialized = True
            if self.first_call_order is not None:
                torch._C._set_sdp_priority_order([_CODES[name] for name in self.first_call_order])
        enabled = enabled_kernels()
        for code in torch._C._get_sdp_priority_order():
            kernel = _NAMES[int(code)]
            if kernel not in enabled:
                continue
            is_causal, gqa = kwargs.get("is_causal", False), kwargs.get("enable_gqa", False)
            if kernel == "MATH" or self.accepts(kernel, query, key, value, attn_mask, 0.0, is_causal, gqa):
                self.kernels.append(kernel)
                # The numbers come from torch's CPU kernels, whatever the emulated selection enabled.
                with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
                    return self.real_sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        raise RuntimeError("No available kernel. Aborting execution.")


TORCH_2_11_SM80 = dict(
    rules={"CUDNN_ATTENTION": _nothing, "FLASH_ATTENTION": _flash, "EFFICIENT_ATTENTION": _efficient_2_11},
)
TORCH_2_13_SM90 = dict(
    rules={"CUDNN_ATTENTION": _anything, "FLASH_ATTENTION": _flash, "EFFICIENT_ATTENTION": _anything},
    first_call_order=("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
)


@pytest.fixture
def fake_cuda(monkeypatch, fused_path_on_cpu):
    """Install a FakeCudaTorch (call it with the rules) as SDPA and as the library's acceptance check, starting from
    torch's order before its first call; torch's order is restored afterwards."""
    saved = list(torch._C._get_sdp_priority_order())

    def install(**setup):
        fake = FakeCudaTorch(real_sdpa=torch.nn.functional.scaled_dot_product_attention, **setup)
        torch._C._set_sdp_priority_order([_CODES[name] for name in fake.initial_order])
        monkeypatch.setattr(sdpa_kernels, "accepts", fake.accepts)
        return fake

    yield install
    torch._C._set_sdp_priority_order(saved)


def test_sm90_runs_every_call_on_cudnn_and_keeps_torchs_order(fake_cuda, monkeypatch):
    fake = fake_cuda(**TORCH_2_13_SM90)
    flags = enabled_kernels()
    model = build_model("llama")  # 4 query heads over 2 KV heads
    for batch in (unpadded_batch(2, 3, 16, 8), make_batch(2, 3, 16, 8)):
        spy = SdpaCalls(fake)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        prompts, pmask, comps, cmask = batch
        errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
        assert errors[0] <= 1e-5 and errors[2] <= 1e-4, errors
        ours = [i for i, call in enumerate(spy.calls) if call["head_dim"] == HEAD_DIM and call["enabled"] != flags]
        assert ours
        assert all(fake.kernels[i] == "CUDNN_ATTENTION" for i in ours)
        assert all(spy.calls[i]["enabled"] == ("CUDNN_ATTENTION",) for i in ours)
        # cuDNN takes grouped heads: none repeated.
        assert all(spy.calls[i]["gqa"] and not spy.calls[i]["same_heads"] for i in ours)
    # torch's own first-call initialization (cuDNN first) survives the library's calls; the flags are restored.
    assert [_NAMES[int(c)] for c in torch._C._get_sdp_priority_order()][:4] == list(TORCH_2_13_SM90["first_call_order"])
    assert enabled_kernels() == flags


def test_torchs_first_call_order_survives_when_the_first_call_is_the_librarys(fake_cuda, monkeypatch):
    # Eager attention: no SDPA call of the model's own comes first (the head check's plain forward is eager).
    fake = fake_cuda(**TORCH_2_13_SM90)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake)
    model = build_model("llama")
    model.set_attn_implementation("eager")
    prompts, pmask, comps, cmask = make_batch(2, 2, 9, 5)
    compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")
    order = [_NAMES[int(c)] for c in torch._C._get_sdp_priority_order()]
    assert order[:4] == list(TORCH_2_13_SM90["first_call_order"]), order


def test_torch_2_11_repeats_heads_only_for_the_kernel_that_needs_it(fake_cuda, monkeypatch):
    fake = fake_cuda(**TORCH_2_11_SM80)
    initial = list(torch._C._get_sdp_priority_order())
    spy = SdpaCalls(fake)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build_model("llama")
    prompts, pmask, comps, cmask = unpadded_batch(2, 3, 16, 8)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert errors[0] <= 1e-5 and errors[2] <= 1e-4, errors
    ours = [(fake.kernels[i], call) for i, call in enumerate(spy.calls) if call["enabled"] != enabled_kernels()]
    prompts = [(kernel, call) for kernel, call in ours if call["key_len"] == 16]
    completions = [(kernel, call) for kernel, call in ours if call["key_len"] == 24]
    assert prompts and completions
    # The prompts' call (causal, no mask): flash, grouped heads native.
    assert all(kernel == "FLASH_ATTENTION" and call["gqa"] and not call["same_heads"] for kernel, call in prompts)
    # The completions' (a mask, grouped heads): flash takes no mask, the memory-efficient kernel no grouped heads:
    # repeated.
    assert all(kernel == "EFFICIENT_ATTENTION" and call["same_heads"] for kernel, call in completions)
    assert list(torch._C._get_sdp_priority_order()) == initial


def test_no_acceptable_kernel_is_a_clear_error(fake_cuda, monkeypatch):
    fake_cuda(rules={"CUDNN_ATTENTION": _nothing, "FLASH_ATTENTION": _nothing, "EFFICIENT_ATTENTION": _nothing})
    monkeypatch.setattr(sdpa_kernels, "ALLOWED_KERNELS", sdpa_kernels.FUSED_KERNELS)
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, 9, 5)
    with pytest.raises(RuntimeError, match="no enabled SDPA kernel"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")


def test_kernels_the_user_disabled_are_not_chosen(fake_cuda, monkeypatch):
    fake = fake_cuda(**TORCH_2_13_SM90)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        model = build_model("llama")
        prompts, pmask, comps, cmask = make_batch(2, 2, 9, 5)
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="expand")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert fake.kernels and "CUDNN_ATTENTION" not in fake.kernels
    assert "EFFICIENT_ATTENTION" in fake.kernels


# ---- explicit scores ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_explicit_scores_over_budget_are_refused_on_fused_path(family, monkeypatch):
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 3, 12, 6)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, backend="expand")
    monkeypatch.setattr(expand_memory, "EXPLICIT_SCORES_BUDGET", 4096)
    compute_logps(model, prompts, comps, **kwargs)  # off the fused path the budget does not apply
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    with pytest.raises(ValueError, match=r"GiB per layer.*backend='flex'"):
        compute_logps(model, prompts, comps, **kwargs)
    monkeypatch.setattr(expand_memory, "EXPLICIT_SCORES_BUDGET", 2**30)
    assert torch.isfinite(compute_logps(model, prompts, comps, **kwargs).logps).all()


def test_math_before_cudnn_in_torchs_order_takes_the_calls_the_kernels_ahead_of_it_reject(fake_cuda, monkeypatch):
    # torch's default order puts math before cuDNN on purpose (older cuDNN mishandled some sequence lengths). A masked
    # call that flash (no mask) and the memory-efficient kernel (here: rejects everything) refuse runs on math there,
    # as torch would run it; walking past math would hand it to cuDNN.
    fake = fake_cuda(rules={"CUDNN_ATTENTION": _anything, "FLASH_ATTENTION": _flash, "EFFICIENT_ATTENTION": _nothing})
    assert [_NAMES[int(c)] for c in torch._C._get_sdp_priority_order()][:4] == list(fake.initial_order[:4])
    spy = SdpaCalls(fake)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build_model("llama")
    prompts, pmask, comps, cmask = unpadded_batch(2, 3, 16, 8)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    assert errors[0] <= 1e-5 and errors[2] <= 1e-4, errors
    ours = [(fake.kernels[i], call) for i, call in enumerate(spy.calls) if call["enabled"] != enabled_kernels()]
    prompts_call = [(kernel, call) for kernel, call in ours if call["key_len"] == 16]  # the prompts' node call
    rows_call = [(kernel, call) for kernel, call in ours if call["key_len"] == 24]  # completions over their prompt
    assert prompts_call and rows_call
    assert all(kernel == "FLASH_ATTENTION" for kernel, _ in prompts_call)  # causal, no mask: flash comes first
    assert all(kernel == "MATH" and call["enabled"] == ("MATH",) for kernel, call in rows_call)
    assert "CUDNN_ATTENTION" not in fake.kernels


def test_excluded_runs_the_dense_yardstick_off_cudnn(fake_cuda, monkeypatch):
    # On sm90 (torch 2.13, recent cuDNN) torch's order puts cuDNN first: the dense path's own SDPA calls run there, as
    # the expand backend's do, so a cuDNN defect would inflate the yardstick with the error it should expose.
    fake = fake_cuda(**TORCH_2_13_SM90)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake)
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 3, 16, 8)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    flags = enabled_kernels()
    plain = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    plain.logps.sum().backward()
    order = list(torch._C._get_sdp_priority_order())
    assert fake.kernels and set(fake.kernels) == {"CUDNN_ATTENTION"}
    fake.kernels.clear()
    with sdpa_kernels.excluded("CUDNN_ATTENTION"):
        assert "CUDNN_ATTENTION" not in enabled_kernels()
        yardstick = compute_logps(model, prompts, comps, backend="dense", **kwargs)
        yardstick.logps.sum().backward()
    assert fake.kernels and "CUDNN_ATTENTION" not in fake.kernels
    assert set(fake.kernels) <= {"FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"}
    assert torch.equal(yardstick.logps, plain.logps)  # the kernel changed, not the numbers (the same CPU kernels)
    # Flags restored and torch's order untouched; the path being judged still runs on cuDNN outside the context.
    assert enabled_kernels() == flags and list(torch._C._get_sdp_priority_order()) == order
    fake.kernels.clear()
    compute_logps(model, prompts, comps, backend="expand", **kwargs)
    assert "CUDNN_ATTENTION" in fake.kernels


def test_excluded_refuses_unknown_names_and_an_empty_set():
    with pytest.raises(ValueError, match="SDPBackend names"):
        with sdpa_kernels.excluded("CUDNN"):
            pass
    with pytest.raises(ValueError, match="no SDPA kernel"):
        with sdpa_kernels.excluded(*sdpa_kernels.ALLOWED_KERNELS):
            pass


# ---- the no-grad budget and grouped heads ---------------------------------------------------------------------------


def _qwen_attention_model():
    """One layer with Qwen2.5-1.5B's attention (hidden 1536, 12 query heads over 2 KV heads of 128), bfloat16."""
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=1536,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=128,
        max_position_embeddings=8192,
    )
    return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize(
    "rules, repeats, rows_per_chunk",
    [
        # cuDNN (first on sm90) takes the masked completions' call with grouped heads natively: only the gathered K/V
        # count, 2048 tokens a completion (its 4608 keys at a third of a hidden state each, and its 512 tokens; the
        # completions under one prompt share one mask row); the first chunk holds the prompt's node too.
        (TORCH_2_13_SM90, False, [12, 4]),
        # torch 2.11 on sm80: flash takes no mask, the memory-efficient kernel no grouped heads, so the heads are
        # repeated (12 x 4608 x 256 x 2 bytes a completion): 11264 tokens a completion, 8 chunks of 2.
        (TORCH_2_11_SM80, True, [2] * 8),
    ],
)
def test_scoring_chunks_count_repeated_heads_only_where_the_kernel_repeats_them(
    fake_cuda, monkeypatch, rules, repeats, rows_per_chunk
):
    from shared_prefix_logps.backends.expand_memory import AttentionShape, node_bytes
    from shared_prefix_logps.engine.budget import DEFAULT_TOKEN_BUDGET, NodeCosts, budgeted_chunks
    from shared_prefix_logps.engine.trie import grouped_trie

    fake = fake_cuda(**rules)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake)
    model = _qwen_attention_model()
    costs = NodeCosts.of(model, torch.device("cpu"), "expand")
    shape = AttentionShape.of_model(model)
    extra = node_bytes(shape, 4096, 512, masked=False, repeats_kv=repeats)  # the mask row counted once per call
    assert costs.node_tokens(4096, 512, own_mask=False) == 512 + -(-extra // (shape.hidden_size * shape.itemsize))
    ones = torch.ones  # P = 4096, C = 512, G = 16
    trie = grouped_trie(
        ones(1, 4096, dtype=torch.long), ones(1, 4096, dtype=torch.bool), ones(16, 512, dtype=torch.long),
        ones(16, 512, dtype=torch.bool), torch.zeros(16, dtype=torch.long),
    )  # fmt: skip
    chunks = budgeted_chunks(trie, torch.arange(16), DEFAULT_TOKEN_BUDGET, costs)
    assert [chunk.numel() for chunk in chunks] == rows_per_chunk

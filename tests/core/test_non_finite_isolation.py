"""A non-finite value in one row stays in that row, in every layout.

A NaN or an inf is planted in the hidden states of one token that a single row holds (the embedding output, or the
output of the first decoder layer), as a bf16 overflow would put it there. Every other row's log-probs must equal the
clean run's exactly, and so must their gradients: the gradient of a loss over the other rows (selected, not multiplied
by a 0/1 mask) with respect to the embedding rows of the tokens the poisoned row does not hold. (Parameter gradients
are sums over every token of a batch, the poisoned one included, so a non-finite row reaches them in any batched
forward, the dense one too; the embedding rows of other tokens are the per-row gradients a shared forward must
keep clean.) The poisoned row itself must come out non-finite, or the planting did not happen.

Layouts: ``compute_logps``'s ``expand`` (its CPU path and its CUDA code path), ``flex``, ``flash`` on the reference
kernels, the searched trie ``compute_logps`` takes when prompts share a system prompt, and ``compute_logps_tree`` /
``chunked_backward_tree`` with ``expand`` and ``flex``, by depth (gradients) and by the depth-first walk (no
gradients, a small token budget).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from support.flash_reference import REFERENCE
from support.graph_counter import allow_flex_backward_on_cpu
from support.tiny_models import VOCAB, build_model
from support.trees import pad_alternating, spy_tree_calls

from shared_prefix_logps import chunked_backward, chunked_backward_tree, compute_logps, compute_logps_tree
from shared_prefix_logps.backends.flash_kernels import substituted
from shared_prefix_logps.engine import sharing

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

#: The token whose hidden states are replaced: held by one row only. Other tokens are drawn above it, so that a
#: poisoned node sorts first among its siblings and its tokens are the ones padded slots would copy.
POISON = 1
VALUES = (float("nan"), float("inf"))
SITES = ("embedding", "hidden")


@contextlib.contextmanager
def planted(model, value: float | None, site: str):
    """Replace the hidden states of every :data:`POISON` token by ``value``: the embedding's output (``embedding``) or
    the first decoder layer's (``hidden``), whatever layout the tokens arrive in. ``value=None`` installs the same
    hooks replacing nothing: the clean run to compare with (a hook on the input embedding takes its weight gradient
    off the chunked backwards' summed buffer, engine/weight_grads.py, which changes its last bits)."""
    seen = {}

    def poison(ids, hidden):
        planted_value = hidden if value is None else torch.full_like(hidden, value)
        return torch.where((ids == POISON)[..., None], planted_value, hidden)

    def on_embedding(module, args, output):
        seen["ids"] = args[0]
        return poison(args[0], output) if site == "embedding" else output

    def on_layer(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = poison(seen["ids"], hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handles = [model.get_input_embeddings().register_forward_hook(on_embedding)]
    if site == "hidden":
        handles.append(model.model.layers[0].register_forward_hook(on_layer))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tokens(gen, count):
    return torch.randint(POISON + 1, VOCAB, (count,), generator=gen)


def two_level_batch(seed: int = 0):
    """(prompts, completions, prompt_mask, completion_mask, poisoned row): 3 prompts (one left-padded), 3
    completions each (some right-padded); the poisoned row's completion holds :data:`POISON` at its second token."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.stack([_tokens(gen, 6) for _ in range(3)])
    completions = torch.stack([_tokens(gen, 5) for _ in range(9)])
    prompt_mask = torch.ones(3, 6, dtype=torch.bool)
    prompt_mask[1, :2] = False
    completion_mask = torch.ones(9, 5, dtype=torch.bool)
    completion_mask[2, 3:] = False
    completion_mask[5, 4:] = False
    bad = 4
    completions[bad, 1] = POISON
    return prompts, completions, prompt_mask, completion_mask, bad


def tree_batch(seed: int = 0):
    """(ids, attention_mask, score_mask, poisoned row): rows under a shared system prompt, the poisoned row's own
    node first among its siblings and longer than they are, so that its first token is what their padded slots
    gathered; some rows left-padded, one a prefix of another, one sharing nothing."""
    gen = torch.Generator().manual_seed(seed)
    system = _tokens(gen, 4).tolist()
    fork = _tokens(gen, 2).tolist()
    rows = [
        system + [POISON, *_tokens(gen, 5).tolist()],
        system + _tokens(gen, 2).tolist(),
        system + fork + _tokens(gen, 3).tolist(),
        system + fork + _tokens(gen, 1).tolist(),
        system + fork,
        _tokens(gen, 4).tolist(),
    ]
    return (*pad_alternating(rows, hole=False), 0)


def _clean_tokens(ids, mask, bad: int) -> torch.Tensor:
    """(k,) int64: real token ids the poisoned row does not hold. Padding is forwarded as token 0 (two-level
    layouts), and the poisoned row's own padding receives its non-finite gradients as in the dense forward (hidden
    keys get ``0 x NaN`` from its queries inside the attention kernel), so token 0 is left out; real tokens are
    drawn above :data:`POISON`."""
    held = torch.zeros(VOCAB, dtype=torch.bool)
    held[ids[bad][mask[bad]]] = True
    held[: POISON + 1] = True
    return (~held).nonzero().squeeze(1)


def _other_rows_loss(logps: torch.Tensor, bad: int) -> torch.Tensor:
    """A weighted sum of every other row's log-probs, the poisoned row selected out (not multiplied by 0)."""
    others = torch.tensor([r for r in range(logps.shape[0]) if r != bad])
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    return (logps[others] * weights[others]).sum()


def _embedding_grad(model) -> torch.Tensor:
    grad = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    return grad


def assert_isolated(run, *, bad: int, clean_tokens: torch.Tensor, model, grads: bool = True):
    """``run()`` -> (logps, embedding gradient or None), clean and with each value planted at each site: the other
    rows' log-probs and the clean tokens' embedding gradients equal the clean run's (under the same hooks), the
    poisoned row is not finite."""
    for site in SITES:
        with planted(model, None, site):
            clean_logps, clean_grad = run()
        assert clean_logps.isfinite().all(), f"the clean run under the {site} hooks is not finite"
        others = [r for r in range(clean_logps.shape[0]) if r != bad]
        for value in VALUES:
            with planted(model, value, site):
                logps, grad = run()
            where = f"{value} planted at the {site}"
            assert not logps[bad].isfinite().all(), f"{where}: the poisoned row came out finite"
            changed = [r for r in others if not torch.equal(logps[r], clean_logps[r])]
            assert not changed, f"{where}: rows {changed} of {others} changed"
            if grads:
                assert torch.equal(grad[clean_tokens], clean_grad[clean_tokens]), (
                    f"{where}: the other rows' embedding gradients changed "
                    f"(non-finite: {int((~grad[clean_tokens].isfinite()).sum())} entries)"
                )


def _model():
    return build_model("llama", tied=False)


@pytest.mark.parametrize("backend", ["expand", "expand-cuda-path", "flex", "flash"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_two_level(backend, grad, request, monkeypatch):
    model = _model()
    prompts, completions, prompt_mask, completion_mask, bad = two_level_batch()
    layout = backend
    stack = contextlib.ExitStack()
    if backend == "expand-cuda-path":
        request.getfixturevalue("fused_path_on_cpu")
        layout = "expand"
    elif backend == "flash":
        stack.enter_context(substituted(REFERENCE))
    elif backend == "flex" and grad:
        allow_flex_backward_on_cpu(monkeypatch)
    group = torch.arange(9) // 3
    clean_tokens = _clean_tokens(
        torch.cat([prompts[group], completions], 1), torch.cat([prompt_mask[group], completion_mask], 1), bad
    )

    def run():
        with torch.set_grad_enabled(grad):
            out = compute_logps(
                model, prompts, completions, prompt_mask=prompt_mask, completion_mask=completion_mask, backend=layout
            )
        if not grad:
            return out.logps, None
        _other_rows_loss(out.logps, bad).backward()
        return out.logps.detach(), _embedding_grad(model)

    with stack:
        assert_isolated(run, bad=bad, clean_tokens=clean_tokens, model=model, grads=grad)


@pytest.mark.parametrize("backend", ["expand", "flex"])
@pytest.mark.parametrize("generations_per_chunk", ["auto", 1], ids=["one_chunk", "chunks"])
def test_two_level_chunked_backward(backend, generations_per_chunk, monkeypatch):
    """``chunked_backward``: in one chunk (with ``flex`` one model call for every depth, its finiteness checked once
    and the call run again isolating when it is not finite) and in chunks of one generation (the calls' outputs cut
    into leaves, isolated from the start: a chunk's backward cannot be run again)."""
    model = _model()
    if backend == "flex":
        allow_flex_backward_on_cpu(monkeypatch)
    prompts, completions, prompt_mask, completion_mask, bad = two_level_batch()
    group = torch.arange(9) // 3
    clean_tokens = _clean_tokens(
        torch.cat([prompts[group], completions], 1), torch.cat([prompt_mask[group], completion_mask], 1), bad
    )
    weights = torch.randn(completions.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(chunk, rows):
        keep = rows != bad  # the poisoned row selected out, not multiplied by 0
        return (chunk.logps[keep] * weights[rows[keep]]).sum()

    def run():
        out = chunked_backward(
            model,
            prompts,
            completions,
            loss_fn,
            prompt_mask=prompt_mask,
            completion_mask=completion_mask,
            generations_per_chunk=generations_per_chunk,
            backend=backend,
        )
        return out.logps, _embedding_grad(model)

    assert_isolated(run, bad=bad, clean_tokens=clean_tokens, model=model)


def _system_prompt_rows():
    """(prompts, completions, prompt_mask, completion_mask, poisoned row): 3 prompts sharing a system prompt (the first
    is the system prompt alone, left-padded), 2 completions each. The poisoned row's completion starts with
    :data:`POISON` and is the longest of its call's nodes, first among them, so that it is what their padded slots
    gathered."""
    gen = torch.Generator().manual_seed(2)
    system = _tokens(gen, 8)
    prompts = torch.stack([torch.cat([_tokens(gen, 3), system])] + [torch.cat([system, _tokens(gen, 3)]) for _ in "ab"])
    prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
    prompt_mask[0, :3] = False
    completions = torch.stack([_tokens(gen, 4) for _ in range(6)])
    completion_mask = torch.ones(6, 4, dtype=torch.bool)
    completion_mask[1:, 2:] = False
    completion_mask[3, 2] = True
    completions[0, 0] = POISON
    return prompts, completions, prompt_mask, completion_mask, 0


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_grouped_entry_taking_the_searched_trie(grad, monkeypatch):
    """compute_logps on prompts that share a system prompt scores them with the trie searched from the rows
    (``expand``; the thresholds lowered so that a small batch takes it)."""
    model = _model()
    monkeypatch.setattr(sharing, "DEEPER_SHARING_MIN_TOKENS", 1)
    monkeypatch.setattr(sharing, "DEEPER_SHARING_MIN_FRACTION", 0.0)
    taken = spy_tree_calls(monkeypatch)
    prompts, completions, prompt_mask, completion_mask, bad = _system_prompt_rows()
    group = torch.arange(6) // 2
    clean_tokens = _clean_tokens(
        torch.cat([prompts[group], completions], 1), torch.cat([prompt_mask[group], completion_mask], 1), bad
    )

    def run():
        with torch.set_grad_enabled(grad):
            out = compute_logps(
                model, prompts, completions, prompt_mask=prompt_mask, completion_mask=completion_mask, backend="expand"
            )
        if not grad:
            return out.logps, None
        _other_rows_loss(out.logps, bad).backward()
        return out.logps.detach(), _embedding_grad(model)

    assert_isolated(run, bad=bad, clean_tokens=clean_tokens, model=model, grads=grad)
    assert taken, "compute_logps did not take the searched trie"


@pytest.mark.parametrize("backend", ["expand", "flex"])
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_tree_scoring(backend, merge):
    """No gradients: by depth (no budget) and by the depth-first walk (a budget of one token per call)."""
    model = _model()
    ids, mask, score, bad = tree_batch()
    for budget in (None, 1):

        def run(budget=budget):
            with torch.no_grad():
                out = compute_logps_tree(
                    model, ids, mask, score, backend=backend, token_budget=budget, merge_tiny_nodes=merge
                )
            return out.logps, None

        assert_isolated(run, bad=bad, clean_tokens=_clean_tokens(ids, mask, bad), model=model, grads=False)


@pytest.mark.parametrize("backend", ["expand", "expand-cuda-path", "flex"])
@pytest.mark.parametrize("entry", ["compute", "chunked"])
def test_tree_gradients(backend, entry, request, monkeypatch):
    model = _model()
    if backend == "flex":
        allow_flex_backward_on_cpu(monkeypatch)
    elif backend == "expand-cuda-path":  # the gathers recomputed in backward (activation checkpointing of attention)
        request.getfixturevalue("fused_path_on_cpu")
        backend = "expand"
    ids, mask, score, bad = tree_batch()

    def run():
        if entry == "compute":
            out = compute_logps_tree(model, ids, mask, score, backend=backend, merge_tiny_nodes=False)
            _other_rows_loss(out.logps, bad).backward()
            return out.logps.detach(), _embedding_grad(model)
        kept = torch.tensor([r for r in range(ids.shape[0]) if r != bad])

        def loss_fn(chunk, rows):
            keep = torch.isin(rows, kept)
            weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))[rows[keep]]
            return (chunk.logps[keep] * weights).sum()

        out = chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=2, backend=backend)
        return out.logps, _embedding_grad(model)

    assert_isolated(run, bad=bad, clean_tokens=_clean_tokens(ids, mask, bad), model=model)

"""Property: every entry point returns the dense forward's numbers, on random shapes, depths, chunkings and layouts.

Hypothesis draws the rows and the options, and each route compares its result with ``backend="dense"`` on the same
rows in float32: log-probs and entropies within 1e-5, every parameter's gradient within 1e-4 relative.

- Grouped batches (prompts, G, lengths, paddings, ids, pad contents) go through ``compute_logps`` with tensors or
  lists, ``compute_logps_concatenated`` with shuffled trainer rows and ``chunked_backward`` in chunks of generations:
  a two-level trie (a system prompt shared by several prompts: three levels).
- Rows for the tree entry points are either drawn from a four-token alphabet (so rows share prefixes at every depth,
  duplicate each other and are prefixes of each other; each row's padding side and its score mask with holes) or a
  grouped batch's ``[prompt | completion]`` rows; they go through ``compute_logps_tree`` and
  ``chunked_backward_tree`` with any ``rows_per_chunk``, tiny nodes merged or not.
- Options: temperature, entropy, token budget (no-grad chunks of the depth-first walk; with gradients it must change
  nothing), the fused head's row chunk; layouts ``expand``, ``flex`` and ``flash`` (on the pure-torch reference of
  flash-attn's varlen kernels) without gradients, ``expand`` with them.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import pytest
import torch
from support.exactness import check_grads_or_exact, parameter_grads
from support.tiny_models import VOCAB, build_model

from shared_prefix_logps import (
    LogpsOutput,
    chunked_backward,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.backends.layouts import LAYOUT_NAMES
from shared_prefix_logps.forward import head_proxy

# Optional (a dev extra): without it this module is reported skipped instead of failing collection, which would stop
# every other test of the run (the GPU script runs on bare images).
hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (pip install hypothesis)")
st = pytest.importorskip("hypothesis.strategies")
HealthCheck, event, given, settings = hypothesis.HealthCheck, hypothesis.event, hypothesis.given, hypothesis.settings

# Eager flex_attention on CPU warns that it is unfused; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Rotary (llama), attention bias and tied head (qwen2), sliding window shorter than the rows (mistral), attention
# and final softcaps with a window (gemma2).
FAMILIES = ("llama", "qwen2", "mistral", "gemma2")

MAX_PROMPTS, MAX_GENERATIONS, MAX_PROMPT_LEN, MAX_COMPLETION_LEN = 3, 4, 8, 6

LOGPS_TOL = 1e-5
GRAD_TOL = 1e-4
GRAD_NOISE = 1e-5

GROUPED = ("tensors", "lists", "concatenated")
TREE = ("tree",)
# Examples per route: eager flex_attention on CPU costs ~0.2-0.5 s per call (and a tiny token budget makes many).
SCORING_EXAMPLES = {"expand": 120, "flex": 25, "flash": 25}
TREE_SCORING_EXAMPLES = {"expand": 40, "flex": 15, "flash": 15}
DEFAULT_EXAMPLES = 15
GRAD_EXAMPLES = {"tensors": 100, "lists": 100, "concatenated": 100, "chunked_backward": 120}
TREE_GRAD_EXAMPLES = {"tree": 40, "chunked_backward_tree": 60}

# Building a model takes longer than checking an example; every example of a family shares one.
_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _model(family: str, dtype=torch.float32) -> torch.nn.Module:
    key = (family, dtype)
    if key not in _MODELS:
        # The float64 copy holds the float32 model's values exactly.
        _MODELS[key] = build_model(family) if dtype == torch.float32 else copy.deepcopy(_model(family)).to(dtype)
    return _MODELS[key]


@dataclass
class Batch:
    """One drawn grouped batch: real tokens per prompt and per completion row, plus what fills the padding."""

    family: str
    generations: int
    prompt_len: int  # P: tensor width of the prompts (>= the longest prompt)
    completion_len: int  # C: tensor width of the completions (>= the longest completion)
    prompts: list[list[int]]
    completions: list[list[int]]  # rows g*G .. g*G+G-1 continue prompt g
    pad_id: int  # what padded positions hold in tensor inputs: masks, not ids, must say what is padding

    def tensors(self, pad_id: int | None = None):
        """(prompts (B, P) left-padded, prompt_mask, completions (B*G, C) right-padded, completion_mask)."""
        pad = self.pad_id if pad_id is None else pad_id
        prompts = torch.full((len(self.prompts), self.prompt_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros(prompts.shape, dtype=torch.bool)
        for i, row in enumerate(self.prompts):
            prompts[i, self.prompt_len - len(row) :] = torch.tensor(row)
            prompt_mask[i, self.prompt_len - len(row) :] = True
        completions = torch.full((len(self.completions), self.completion_len), pad, dtype=torch.long)
        completion_mask = torch.zeros(completions.shape, dtype=torch.bool)
        for i, row in enumerate(self.completions):
            if row:
                completions[i, : len(row)] = torch.tensor(row)
                completion_mask[i, : len(row)] = True
        return prompts, prompt_mask, completions, completion_mask


@dataclass
class Rows:
    """Rows for the tree entry points: ids, attention mask and score mask, (N, L) each."""

    family: str
    ids: torch.Tensor
    mask: torch.Tensor
    score: torch.Tensor


ids = st.integers(0, VOCAB - 1)


@st.composite
def batches(draw) -> Batch:
    num_prompts = draw(st.integers(1, MAX_PROMPTS))
    generations = draw(st.integers(1, MAX_GENERATIONS))
    prompt_len = draw(st.integers(1, MAX_PROMPT_LEN))
    completion_len = draw(st.integers(1, MAX_COMPLETION_LEN))
    # Lengths are drawn as padding (0 is the simplest draw), so a simple example still has a prefix to share.
    prompt_pads = st.lists(st.integers(0, prompt_len - 1), min_size=num_prompts, max_size=num_prompts)
    prompt_lengths = [prompt_len - pad for pad in draw(prompt_pads)]
    # One example in eight has one-token prompts only, also when the prompt tensor is wider.
    if draw(st.integers(0, 7)) == 7:
        prompt_lengths = [1] * num_prompts
    rows = num_prompts * generations
    completion_pads = st.lists(st.integers(0, completion_len), min_size=rows, max_size=rows)
    completion_lengths = [completion_len - pad for pad in draw(completion_pads)]
    prompts = [draw(st.lists(ids, min_size=n, max_size=n)) for n in prompt_lengths]
    # One example in six: the prompts share a (system) prefix, which a deeper trie forwards once.
    if num_prompts > 1 and draw(st.integers(0, 5)) == 5:
        shared = min(prompt_lengths) - 1
        prompts = [prompts[0][:shared] + p[shared:] for p in prompts]
    completions = [draw(st.lists(ids, min_size=n, max_size=n)) for n in completion_lengths]
    return Batch(
        family=draw(st.sampled_from(FAMILIES)),
        generations=generations,
        prompt_len=prompt_len,
        completion_len=completion_len,
        prompts=prompts,
        completions=completions,
        pad_id=draw(st.sampled_from([0, VOCAB - 1, -100])),
    )


def _place(draw, rows: list[list[int]], width: int, scored) -> tuple[torch.Tensor, ...]:
    """Rows into (N, width) tensors, each left- or right-padded as drawn; ``scored(i, t)`` for real position t."""
    tensor = torch.full((len(rows), width), 7, dtype=torch.long)  # padding holds a real id: masks decide, not ids
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    score = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        start = width - len(row) if draw(st.booleans()) else 0
        tensor[i, start : start + len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, start : start + len(row)] = True
        for t in range(1, len(row)):
            score[i, start + t] = scored(i, t)
    return tensor, mask, score


@st.composite
def tree_rows(draw) -> Rows:
    """Rows from a four-token alphabet (prefixes shared at every depth), holes in the score mask."""
    rows = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=7))
    rows = [[token * 13 + 5 for token in row] for row in rows]  # spread over the vocabulary
    width = max(len(r) for r in rows) + draw(st.integers(0, 2))
    holes = draw(st.lists(st.booleans(), min_size=len(rows) * width, max_size=len(rows) * width))
    tensors = _place(draw, rows, width, lambda i, t: not holes[i * width + t])
    return Rows(draw(st.sampled_from(FAMILIES)), *tensors)


@st.composite
def grouped_rows(draw) -> Rows:
    """A grouped batch's ``[prompt | completion]`` rows, each completion token scored."""
    batch = draw(batches())
    prompts = [batch.prompts[i // batch.generations] for i in range(len(batch.completions))]
    rows = [p + c for p, c in zip(prompts, batch.completions)]
    tensors = _place(draw, rows, batch.prompt_len + batch.completion_len, lambda i, t: t >= len(prompts[i]))
    return Rows(batch.family, *tensors)


temperatures = st.one_of(st.just(1.0), st.floats(0.25, 4.0, allow_nan=False, allow_infinity=False))


def _weights(shape):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _loss(out: LogpsOutput, rows: torch.Tensor, weights) -> torch.Tensor:
    """Every position weighted differently, so a value or gradient routed to the wrong token shows."""
    w_logps, w_entropy = weights
    loss = (out.logps * w_logps[rows]).sum()
    if out.entropy is not None:
        loss = loss + (out.entropy * w_entropy[rows]).sum()
    return loss


def _describe(batch: Batch, route: str) -> None:
    """Label the example for ``pytest --hypothesis-show-statistics`` (which cases the run covered)."""
    event(f"{batch.family} {route}")
    event(f"G={batch.generations}")
    prompt_lengths = [len(row) for row in batch.prompts]
    if max(prompt_lengths) == 1:
        event("every prompt one token")
    elif min(prompt_lengths) == 1:
        event("some prompt one token")
    if max(prompt_lengths) < batch.prompt_len:
        event("prompt columns padded in every row")
    completion_lengths = [len(row) for row in batch.completions]
    if max(completion_lengths) == 0:
        event("every completion empty")
    elif min(completion_lengths) == 0:
        event("some completion empty")
    if len(set(map(tuple, batch.prompts))) < len(batch.prompts):
        event("repeated prompt")
    if batch.prompt_len + batch.completion_len > 6:
        event("rows longer than the sliding windows")


def _dense(model, batch, temperature: float, return_entropy: bool) -> LogpsOutput:
    """The reference: ``backend="dense"`` on the same rows (a grouped batch as tensors whose padding holds 0,
    whatever pad_id the tested route sees)."""
    options = dict(temperature=temperature, return_entropy=return_entropy, backend="dense")
    if isinstance(batch, Rows):
        return compute_logps_tree(model, batch.ids, batch.mask, batch.score, **options)
    prompts, prompt_mask, completions, completion_mask = batch.tensors(pad_id=0)
    return compute_logps(
        model, prompts, completions, prompt_mask=prompt_mask, completion_mask=completion_mask, **options
    )


def _run(model, batch, entry: str, data, **kwargs) -> LogpsOutput:
    """The rows through ``entry`` (no chunked backward); they come back in the batch's order (differentiably)."""
    if entry == "tree":
        merge = data.draw(st.booleans(), label="merge_tiny_nodes")
        return compute_logps_tree(model, batch.ids, batch.mask, batch.score, merge_tiny_nodes=merge, **kwargs)
    if entry == "lists":
        out = compute_logps(model, batch.prompts, batch.completions, **kwargs)
        # Lists are padded to their longest completion; widen to the batch's C (the extra columns are padding).
        assert out.logps.shape[1] == max(len(row) for row in batch.completions)
        extra = batch.completion_len - out.logps.shape[1]
        widen = lambda t: None if t is None else torch.nn.functional.pad(t, (0, extra))
        return LogpsOutput(widen(out.logps), widen(out.entropy), widen(out.mask))
    prompts, prompt_mask, completions, completion_mask = batch.tensors()
    if entry == "tensors":
        return compute_logps(
            model, prompts, completions, prompt_mask=prompt_mask, completion_mask=completion_mask, **kwargs
        )
    assert entry == "concatenated"
    # TRL's layout: [left-padded prompt | right-padded completion] per row, rows in any order.
    permutation = data.draw(st.permutations(range(len(batch.completions))), label="row order")
    group = torch.arange(len(batch.prompts)).repeat_interleave(batch.generations)
    order = torch.tensor(permutation, dtype=torch.long)
    input_ids = torch.cat([prompts[group], completions], dim=1)[order]
    attention_mask = torch.cat([prompt_mask[group], completion_mask], dim=1)[order].long()
    out = compute_logps_concatenated(model, input_ids, attention_mask, batch.completion_len, **kwargs)
    inverse = torch.argsort(order)
    return LogpsOutput(out.logps[inverse], None if out.entropy is None else out.entropy[inverse], out.mask[inverse])


def _chunked(model, batch, entry: str, data, loss_fn, **options) -> LogpsOutput:
    """``chunked_backward`` (chunks of generations) or ``chunked_backward_tree`` (chunks of rows) of ``loss_fn``."""
    if entry == "chunked_backward_tree":
        per_chunk = data.draw(st.integers(1, 4), label="rows_per_chunk")
        merge = data.draw(st.booleans(), label="merge_tiny_nodes")
        return chunked_backward_tree(
            model, batch.ids, batch.mask, batch.score, loss_fn, rows_per_chunk=per_chunk, merge_tiny_nodes=merge,
            **options,
        )  # fmt: skip
    per_chunk = data.draw(st.integers(1, batch.generations), label="generations_per_chunk")
    event(f"chunks of generations: {-(-batch.generations // per_chunk)}")
    prompts, prompt_mask, completions, completion_mask = batch.tensors()
    return chunked_backward(
        model, prompts, completions, loss_fn, generations_per_chunk=per_chunk, prompt_mask=prompt_mask,
        completion_mask=completion_mask, **options,
    )  # fmt: skip


def _check_values(out: LogpsOutput, dense: LogpsOutput, return_entropy: bool) -> None:
    assert out.logps.dtype == torch.float32
    assert out.logps.shape == dense.logps.shape
    assert torch.equal(out.mask, dense.mask)
    assert (out.logps <= 0).all()
    assert (out.logps[~out.mask] == 0).all()
    assert (out.logps.detach() - dense.logps.detach()).abs().max().item() <= LOGPS_TOL
    if return_entropy:
        assert out.entropy.dtype == torch.float32
        assert (out.entropy[~out.mask] == 0).all()
        assert (out.entropy.detach() - dense.entropy.detach()).abs().max().item() <= LOGPS_TOL
    else:
        assert out.entropy is None


@contextmanager
def head_chunk_rows_set_to(rows):
    """The fused head's row chunk set for one example, restored afterwards."""
    saved = head_proxy.HEAD_CHUNK_ROWS
    head_proxy.HEAD_CHUNK_ROWS = rows
    try:
        yield
    finally:
        head_proxy.HEAD_CHUNK_ROWS = saved


COMMON_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _drawn(entry: str) -> dict:
    """What an example of ``entry`` draws: its rows and the options."""
    rows = st.one_of(tree_rows(), grouped_rows()) if entry in ("tree", "chunked_backward_tree") else batches()
    return dict(
        batch=rows,
        temperature=temperatures,
        return_entropy=st.booleans(),
        token_budget=st.one_of(st.none(), st.integers(1, 64)),
        head_chunk=st.one_of(st.none(), st.integers(1, 8)),
        data=st.data(),
    )


def _layout(backend: str):
    """``flash`` runs on the pure-torch reference of flash-attn's varlen kernels (windowed layers go to eager flex)."""
    if backend != "flash":
        return nullcontext()
    from support.flash_reference import REFERENCE

    from shared_prefix_logps.backends.flash_kernels import substituted

    return substituted(REFERENCE)


def _scoring_test(entry: str, backend: str, examples: int):
    """No-grad scoring (token budgets chunk the depth-first walk) of ``entry`` on ``backend`` equals the dense path."""

    @settings(max_examples=examples, **COMMON_SETTINGS)
    @given(**_drawn(entry))
    def check(batch, temperature, return_entropy, token_budget, head_chunk, data):
        model = _model(batch.family)
        if isinstance(batch, Batch):
            _describe(batch, f"{entry}/{backend}")
        event(f"token_budget={'none' if token_budget is None else 'tiny' if token_budget < 16 else 'small'}")
        options = dict(temperature=temperature, return_entropy=return_entropy)
        with torch.no_grad():
            dense = _dense(model, batch, **options)
            with head_chunk_rows_set_to(head_chunk), _layout(backend):
                out = _run(model, batch, entry, data, backend=backend, token_budget=token_budget, **options)
        _check_values(out, dense, return_entropy)

    return check


# Each route gets its own examples: Hypothesis spends many of a shared budget on variants of one example. Every layout
# of the table runs (a new one gets the default examples).
@pytest.mark.parametrize("backend", LAYOUT_NAMES)
@pytest.mark.parametrize("entry", [*GROUPED, *TREE])
def test_scoring_matches_dense(entry, backend):
    examples = (TREE_SCORING_EXAMPLES if entry in TREE else SCORING_EXAMPLES).get(backend, DEFAULT_EXAMPLES)
    _scoring_test(entry, backend, examples)()


def _gradient_test(entry: str, examples: int):
    """With gradients (expand) log-probs, entropies and every parameter's gradient equal those of the dense path."""

    @settings(max_examples=examples, **COMMON_SETTINGS)
    @given(**_drawn(entry))
    def check(batch, temperature, return_entropy, token_budget, head_chunk, data):
        if isinstance(batch, Batch):
            _describe(batch, entry)
        model = _model(batch.family)
        options = dict(temperature=temperature, return_entropy=return_entropy)
        dense = _dense(model, batch, **options)
        weights = _weights(dense.logps.shape)
        everything = torch.arange(dense.logps.shape[0])
        # With nothing scored nothing depends on the parameters (dense returns constant zeros).
        anything = bool(dense.mask.any())
        expected = parameter_grads(model, _loss(dense, everything, weights)) if anything else None
        with head_chunk_rows_set_to(head_chunk):
            if entry.startswith("chunked_backward"):
                model.zero_grad(set_to_none=True)
                try:
                    loss_fn = lambda chunk, rows: _loss(chunk, rows, weights)
                    out = _chunked(model, batch, entry, data, loss_fn, backend="expand", **options)
                    grads = {
                        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()
                    }
                finally:
                    model.zero_grad(set_to_none=True)
                assert not out.logps.requires_grad
            else:
                # token_budget only applies without gradients; with them it must change nothing.
                out = _run(model, batch, entry, data, backend="expand", token_budget=token_budget, **options)
                # Connected to the model's graph even when every token is masked (a trainer's zero loss
                # back-propagates).
                assert out.logps.requires_grad
                grads = parameter_grads(model, _loss(out, everything, weights))
        _check_values(out, dense, return_entropy)
        if anything:

            def exact_grads():
                event("float32 gradient noise checked against float64")
                exact_model = _model(batch.family, torch.float64)
                return parameter_grads(exact_model, _loss(_dense(exact_model, batch, **options), everything, weights))

            check_grads_or_exact(grads, expected, exact_grads, tol=GRAD_TOL, noise=GRAD_NOISE)
        else:
            assert all(g.abs().max() == 0 for g in grads.values())

    return check


@pytest.mark.parametrize("entry", [*GROUPED, "chunked_backward", *TREE, "chunked_backward_tree"])
def test_gradients_match_dense(entry):
    examples = GRAD_EXAMPLES.get(entry) or TREE_GRAD_EXAMPLES[entry]
    _gradient_test(entry, examples)()

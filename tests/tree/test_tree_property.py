"""Property: the tree entry points return the dense forward's numbers on random rows.

Hypothesis draws rows from a four-token alphabet (so rows share prefixes at every depth, duplicate each other and
are prefixes of each other), each row's padding side, the score mask, the family, temperature, token budget and
route: ``compute_logps_tree`` without gradients (``expand`` and ``flex``) and with them, ``chunked_backward_tree``
with any ``rows_per_chunk``. Float32: log-probs and entropies within 1e-5 of ``backend="dense"``, every parameter
gradient within 1e-4 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.exactness import check_grads_or_exact
from support.tiny_models import build_model

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree

hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (pip install hypothesis)")
st = pytest.importorskip("hypothesis.strategies")
HealthCheck, given, settings = hypothesis.HealthCheck, hypothesis.given, hypothesis.settings

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_torch_thread"),
]

FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
GRAD_TOL = 1e-4
GRAD_NOISE = 1e-5
_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _model(family, dtype=torch.float32):
    key = (family, dtype)
    if key not in _MODELS:
        # The float64 copy holds the float32 model's values exactly.
        _MODELS[key] = build_model(family) if dtype == torch.float32 else copy.deepcopy(_model(family)).to(dtype)
    return _MODELS[key]


@st.composite
def tree_batches(draw):
    rows = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=7))
    width = max(len(r) for r in rows) + draw(st.integers(0, 2))
    ids = torch.full((len(rows), width), 7, dtype=torch.long)  # padding holds a real id: masks decide, not ids
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        left = draw(st.booleans())
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row) * 13 + 5  # spread over the vocabulary
        mask[i, span] = True
    first = mask.long().argmax(1)
    allowed = mask.clone()
    allowed[torch.arange(len(rows)), first] = False
    holes = torch.tensor(draw(st.lists(st.booleans(), min_size=ids.numel(), max_size=ids.numel()))).view(ids.shape)
    return ids, mask, allowed & ~holes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=tree_batches(),
    family=st.sampled_from(FAMILIES),
    temperature=st.sampled_from([1.0, 0.6]),
    route=st.sampled_from(["scoring", "flex", "grad", "chunked"]),
    budget=st.sampled_from([1, 16, None]),
    rows_per_chunk=st.integers(1, 4),
)
def test_tree_matches_dense(batch, family, temperature, route, budget, rows_per_chunk):
    ids, mask, score = batch
    model = _model(family)
    options = dict(temperature=temperature, return_entropy=True)
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(ids.shape, generator=gen)

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum() + (out.entropy * weights.flip(1)[rows]).sum()

    dense = compute_logps_tree(model, ids, mask, score, backend="dense", **options)
    every = torch.arange(ids.shape[0])
    if route in ("scoring", "flex"):
        backend = "flex" if route == "flex" else "expand"
        with torch.no_grad():
            out = compute_logps_tree(model, ids, mask, score, token_budget=budget, backend=backend, **options)
    else:
        loss_fn(dense, every).backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        if route == "grad":
            out = compute_logps_tree(model, ids, mask, score, **options)
            loss_fn(out, every).backward()
        else:
            out = chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=rows_per_chunk, **options)
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

        def exact_grads():
            double = _model(family, torch.float64)
            out64 = compute_logps_tree(double, ids, mask, score, backend="dense", **options)
            loss = (out64.logps * weights[every].double()).sum() + (out64.entropy * weights.flip(1).double()).sum()
            params = [p for _, p in double.named_parameters()]
            found = torch.autograd.grad(loss, params, allow_unused=True)
            return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(double.named_parameters(), found)}

        check_grads_or_exact(grads, reference, exact_grads, tol=GRAD_TOL, noise=GRAD_NOISE)
    assert (out.logps - dense.logps).abs().max().item() < 1e-5
    assert (out.entropy - dense.entropy).abs().max().item() < 1e-5

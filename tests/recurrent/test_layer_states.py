"""One recurrent layer continued from a given state (shared_prefix_logps.recurrent.layer) against the same layer's own
forward over the whole row: outputs within 1e-5, every gradient (parameters and the layer input, so the prefix
receives the suffix's gradient through the state) within 1e-4 relative, in float32 and float64."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from support.exactness import max_relative_grad_error
from support.hybrid_models import CONV_KERNEL, GDN_CHUNK_SIZE, HYBRID_FAMILIES, build_hybrid, recurrent_layers

from shared_prefix_logps.recurrent import NodeSpans, RecurrentState, run_from_states
from shared_prefix_logps.recurrent.cache import state_cache
from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS
from shared_prefix_logps.recurrent.layer import cache_argument

# The state cache speaks the linear-attention cache layer of transformers >= 5.15 (see families.MIN_TRANSFORMERS).
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < MIN_TRANSFORMERS, reason=f"needs transformers >= {MIN_TRANSFORMERS}"
)

LENGTH = 2 * GDN_CHUNK_SIZE + 12  # three chunks of the recurrence's kernel

#: Split points per row (several rows per case, so nodes of different lengths share one call): one-token prefixes,
#: prefixes shorter than the convolution kernel, the chunk boundaries and their neighbours, one-token suffixes.
SPLITS = [
    (1, 2, CONV_KERNEL - 1),
    (CONV_KERNEL, GDN_CHUNK_SIZE - 1, GDN_CHUNK_SIZE),
    (GDN_CHUNK_SIZE + 1, 2 * GDN_CHUNK_SIZE, 2 * GDN_CHUNK_SIZE + 1),
    (LENGTH - 1, LENGTH - 2, 37),
]


def _mixer(family: str, dtype=torch.float32, **kwargs):
    model = build_hybrid(family, dtype=dtype, **kwargs)
    return recurrent_layers(model)[-1]  # the layer after the attention layer


def _grads(mixer, hidden, output, weight, positions=None):
    """Gradients of a weighted sum of ``output`` (over ``positions``, a (rows, columns) bool mask, or everywhere)
    with respect to ``hidden`` and every parameter of ``mixer``."""
    loss_terms = output * weight
    if positions is not None:
        loss_terms = loss_terms * positions[..., None]
    names = ["hidden"] + [name for name, _ in mixer.named_parameters()]
    grads = torch.autograd.grad(loss_terms.sum(), [hidden, *mixer.parameters()])
    return dict(zip(names, grads))


def _prefix_then_suffix(mixer, hidden, cut):
    """Each row's first ``cut[r]`` tokens as one node, the rest continuing from its end state; the two outputs
    joined back into rows."""
    rows, columns = hidden.shape[:2]
    prefix = NodeSpans(row=torch.arange(rows), start=torch.zeros(rows, dtype=torch.long), length=cut)
    prefix_out, prefix_end = run_from_states(mixer, hidden, prefix)
    suffix = NodeSpans(row=torch.arange(rows), start=cut, length=columns - cut)
    suffix_out, suffix_end = run_from_states(mixer, hidden, suffix, prefix_end)
    in_prefix = torch.arange(columns)[None, :] < cut[:, None]
    return torch.where(in_prefix[..., None], prefix_out, suffix_out), prefix_end, suffix_end


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_prefix_then_suffix_from_its_state_equals_the_full_row(family, splits):
    mixer = _mixer(family)
    torch.manual_seed(1)
    cut = torch.tensor(splits)
    hidden = torch.randn(len(splits), LENGTH, 32, requires_grad=True)
    weight = torch.randn(len(splits), LENGTH, 32)

    reference = mixer(hidden)
    joined, _, suffix_end = _prefix_then_suffix(mixer, hidden, cut)

    assert (joined - reference).abs().max().item() < 1e-5
    assert (
        max_relative_grad_error(_grads(mixer, hidden, joined, weight), _grads(mixer, hidden, reference, weight)) < 1e-4
    )
    # The state at the row's end is the one the layer stores in its cache after a plain forward over the whole row.
    cache, layer = state_cache(mixer.layer_idx, None, CONV_KERNEL)
    mixer(hidden, **{cache_argument(mixer.forward): cache})
    own_end = layer.end_state()
    for got, expected in zip(suffix_end.tensors(), own_end.tensors()):
        assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_suffix_gradient_reaches_the_prefix_through_the_state(family):
    """A loss on suffix positions only: its gradient with respect to the prefix's inputs flows through the end state
    alone, and matches the full row's."""
    mixer = _mixer(family)
    torch.manual_seed(2)
    cut = torch.tensor([CONV_KERNEL - 2, GDN_CHUNK_SIZE, 70])
    hidden = torch.randn(3, 90, 32, requires_grad=True)
    weight = torch.randn(3, 90, 32)
    in_suffix = torch.arange(90)[None, :] >= cut[:, None]

    joined, _, _ = _prefix_then_suffix(mixer, hidden, cut)
    got = _grads(mixer, hidden, joined, weight, in_suffix)
    expected = _grads(mixer, hidden, mixer(hidden), weight, in_suffix)

    prefix_grad = got["hidden"] * (~in_suffix)[..., None]
    assert prefix_grad.abs().sum(-1).gt(0).sum() == int(cut.sum())  # every prefix token receives a gradient
    assert max_relative_grad_error(got, expected) < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_state_forked_to_several_children_collects_their_gradients(family):
    """One prefix, G = 4 children of different lengths starting from its end state (``select`` with a repeated
    index): outputs and every gradient equal the 4 full rows [prefix | child] through the layer's own forward."""
    mixer = _mixer(family)
    torch.manual_seed(3)
    prefix_length, children = 9, [1, 5, GDN_CHUNK_SIZE, 3]
    prefix = torch.randn(1, prefix_length, 32, requires_grad=True)
    suffixes = torch.randn(len(children), max(children), 32, requires_grad=True)
    weight = torch.randn(len(children), max(children), 32)

    _, prefix_end = run_from_states(mixer, prefix, NodeSpans.packed(torch.tensor([prefix_length])))
    child_spans = NodeSpans(
        row=torch.arange(len(children)),
        start=torch.zeros(len(children), dtype=torch.long),
        length=torch.tensor(children),
    )
    fork = torch.zeros(len(children), dtype=torch.long)
    child_out, _ = run_from_states(mixer, suffixes, child_spans, prefix_end.select(fork))
    valid = torch.arange(max(children))[None, :] < torch.tensor(children)[:, None]
    loss = (child_out * weight * valid[..., None]).sum()

    reference_loss = 0.0
    for g, size in enumerate(children):
        row = torch.cat([prefix[0], suffixes[g, :size]])[None]
        out = mixer(row)[0, prefix_length:]
        assert (out - child_out[g, :size]).abs().max().item() < 1e-5
        reference_loss = reference_loss + (out * weight[g, :size]).sum()

    leaves = [prefix, suffixes, *mixer.parameters()]
    names = ["prefix", "suffixes"] + [name for name, _ in mixer.named_parameters()]
    got = dict(zip(names, torch.autograd.grad(loss, leaves)))
    expected = dict(zip(names, torch.autograd.grad(reference_loss, leaves)))
    assert got["prefix"].abs().sum() > 0
    assert max_relative_grad_error(got, expected) < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_left_padded_rows_give_the_unpadded_rows_state(family):
    mixer = _mixer(family)
    torch.manual_seed(4)
    lengths = [1, CONV_KERNEL - 2, 20, 23]
    width = max(lengths)
    rows = [torch.randn(1, n, 32) for n in lengths]
    padded = torch.zeros(len(lengths), width, 32)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for r, n in enumerate(lengths):
        padded[r, width - n :] = rows[r][0]
        mask[r, width - n :] = True

    output, end = run_from_states(mixer, padded, NodeSpans.from_mask(mask))
    own_masked = mixer(padded, attention_mask=mask.to(padded.dtype))
    for r, n in enumerate(lengths):
        alone, alone_end = run_from_states(mixer, rows[r], NodeSpans.packed(torch.tensor([n])))
        assert (output[r, width - n :] - alone[0]).abs().max().item() < 1e-5
        assert not output[r, : width - n].any()  # padding is not run: the output is zero there
        for got, expected in zip(end.select(torch.tensor([r])).tensors(), alone_end.tensors()):
            assert (got - expected).abs().max().item() < 1e-5
        # The model's own masking is exact for these layers too (no projection bias: padded steps write nothing, and
        # the zero state they decay stays zero), so its dense reference on left-padded rows is the unpadded one.
        assert (own_masked[r, width - n :] - alone[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_right_padded_rows_end_at_their_own_end(family):
    """Right padding is not neutral in the model's own forward (each padded step decays the state by the gate of a
    zero input), so the state must be taken at each row's own end: the spans never scan the padding."""
    mixer = _mixer(family)
    torch.manual_seed(5)
    lengths = torch.tensor([3, 11, 30])
    hidden = torch.randn(3, 30, 32)
    mask = torch.arange(30)[None, :] < lengths[:, None]
    _, end = run_from_states(mixer, hidden, NodeSpans.from_mask(mask))
    for r, n in enumerate(lengths.tolist()):
        _, alone_end = run_from_states(mixer, hidden[r : r + 1, :n], NodeSpans.packed(torch.tensor([n])))
        for got, expected in zip(end.select(torch.tensor([r])).tensors(), alone_end.tensors()):
            assert (got - expected).abs().max().item() < 1e-5

    # What the model's own cache would hand on from the padded rows differs: that is what the spans avoid.
    _, padded_end = run_from_states(mixer, hidden, NodeSpans.from_mask(torch.ones(3, 30, dtype=torch.bool)))
    recurrence = next(iter(end.recurrence))
    assert (padded_end.recurrence[recurrence][0] - end.recurrence[recurrence][0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_packed_nodes_run_as_if_alone(family):
    """Several nodes back to back in one row (a node call's packed layout), each from its own initial state."""
    mixer = _mixer(family)
    torch.manual_seed(6)
    lengths = torch.tensor([5, 1, 17, 2])
    packed = torch.randn(1, int(lengths.sum()), 32)
    _, parent_end = run_from_states(
        mixer, torch.randn(4, 7, 32), NodeSpans.from_mask(torch.ones(4, 7, dtype=torch.bool))
    )
    output, end = run_from_states(mixer, packed, NodeSpans.packed(lengths), parent_end)
    start = 0
    for node, n in enumerate(lengths.tolist()):
        alone, alone_end = run_from_states(
            mixer,
            packed[:, start : start + n],
            NodeSpans.packed(torch.tensor([n])),
            parent_end.select(torch.tensor([node])),
        )
        assert (output[:, start : start + n] - alone).abs().max().item() < 1e-5
        for got, expected in zip(end.select(torch.tensor([node])).tensors(), alone_end.tensors()):
            assert (got - expected).abs().max().item() < 1e-5
        start += n


def test_a_zero_state_is_the_state_before_a_rows_first_token():
    mixer = _mixer("qwen3_5_text")
    torch.manual_seed(7)
    hidden = torch.randn(2, 9, 32)
    spans = NodeSpans.from_mask(torch.ones(2, 9, dtype=torch.bool))
    output, end = run_from_states(mixer, hidden, spans)
    zero_output, zero_end = run_from_states(mixer, hidden, spans, end.zeros(2))
    assert (zero_output - output).abs().max().item() < 1e-6
    for a, b in zip(zero_end.tensors(), end.tensors()):
        assert (a - b).abs().max().item() < 1e-6


def test_the_initial_state_is_never_written():
    """transformers' cache layers copy states in place; the state cache must not (the parent's state is saved for
    backward and shared by its other children)."""
    mixer = _mixer("qwen3_next")
    torch.manual_seed(8)
    _, end = run_from_states(mixer, torch.randn(2, 6, 32), NodeSpans.from_mask(torch.ones(2, 6, dtype=torch.bool)))
    leaves = end.detached()
    versions = [t._version for t in leaves.tensors()]
    values = [t.clone() for t in leaves.tensors()]
    for length in (1, 4):  # the one-token decode path and the chunked path
        out, _ = run_from_states(
            mixer, torch.randn(2, length, 32), NodeSpans.from_mask(torch.ones(2, length, dtype=torch.bool)), leaves
        )
        out.sum().backward()
    assert [t._version for t in leaves.tensors()] == versions
    assert all(torch.equal(a, b) for a, b in zip(leaves.tensors(), values))
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves.tensors())


def test_float64():
    """The model in float64 (transformers' torch kernel still computes the recurrence in float32)."""
    mixer = _mixer("qwen3_5_text", dtype=torch.float64)
    torch.manual_seed(9)
    cut = torch.tensor([1, GDN_CHUNK_SIZE, 100])
    hidden = torch.randn(3, LENGTH, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, LENGTH, 32, dtype=torch.float64)
    reference = mixer(hidden)
    joined, _, _ = _prefix_then_suffix(mixer, hidden, cut)
    assert joined.dtype == torch.float64
    assert (joined - reference).abs().max().item() < 1e-5
    assert (
        max_relative_grad_error(_grads(mixer, hidden, joined, weight), _grads(mixer, hidden, reference, weight)) < 1e-4
    )


def test_default_decays_within_the_models_own_rounding():
    """With the model's own decay initialisation the float32 kernel rounds the decay parameters' gradients at
    ~1e-4 relative (see build_hybrid). The split then stays within a few times what the model's own dense forward
    moves when its rows are shifted by masked padding (identical in exact arithmetic)."""
    mixer = _mixer("qwen3_5_text", decay="default")
    torch.manual_seed(10)
    cut = torch.tensor([3, GDN_CHUNK_SIZE + 1, 100])
    hidden = torch.randn(3, LENGTH, 32, requires_grad=True)
    weight = torch.randn(3, LENGTH, 32)
    reference = _grads(mixer, hidden, mixer(hidden), weight)

    shift = 33
    padded = torch.cat([torch.zeros(3, shift, 32), hidden], 1)
    mask = torch.cat([torch.zeros(3, shift), torch.ones(3, LENGTH)], 1)
    shifted = mixer(padded, attention_mask=mask)[:, shift:]
    noise = max_relative_grad_error(_grads(mixer, hidden, shifted, weight), reference)

    joined, _, _ = _prefix_then_suffix(mixer, hidden, cut)
    error = max_relative_grad_error(_grads(mixer, hidden, joined, weight), reference)
    assert noise > 1e-6  # the rounding this test is about is present
    assert error < max(10 * noise, 1e-4), (error, noise)


def test_recurrent_state_layout():
    conv, recurrence = torch.randn(3, 5, 2), torch.randn(3, 2, 4, 4)
    state = RecurrentState(conv={0: conv}, recurrence={0: recurrence})
    assert state.rows == 3
    assert state.nbytes == (conv.numel() + recurrence.numel()) * 4
    picked = state.select(torch.tensor([2, 2, 0]))
    assert torch.equal(picked.conv[0], conv[[2, 2, 0]]) and torch.equal(picked.recurrence[0], recurrence[[2, 2, 0]])
    joined = RecurrentState.cat([state, picked])
    assert joined.rows == 6 and torch.equal(joined.recurrence[0][3:], recurrence[[2, 2, 0]])
    assert state.zeros(2).conv[0].shape == (2, 5, 2) and not state.zeros(2).conv[0].any()
    leaves = state.detached()
    assert all(t.is_leaf and t.requires_grad for t in leaves.tensors())
    with pytest.raises(ValueError, match="expected 2 tensors"):
        state.from_tensors([conv])


def test_node_spans_reject_bad_layouts():
    with pytest.raises(ValueError, match="contiguous"):
        NodeSpans.from_mask(torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="at least one real token"):
        NodeSpans.from_mask(torch.tensor([[0, 0], [1, 1]]))
    with pytest.raises(ValueError, match="length >= 1"):
        NodeSpans(row=torch.tensor([0]), start=torch.tensor([0]), length=torch.tensor([0]))
    mixer = _mixer("qwen3_5_text")
    with pytest.raises(ValueError, match="runs past"):
        run_from_states(mixer, torch.randn(1, 4, 32), NodeSpans.packed(torch.tensor([3, 2])))
    _, end = run_from_states(mixer, torch.randn(1, 4, 32), NodeSpans.packed(torch.tensor([4])))
    with pytest.raises(ValueError, match="1 states for 2 nodes"):
        run_from_states(mixer, torch.randn(1, 4, 32), NodeSpans.packed(torch.tensor([2, 2])), end)


def test_cache_argument_found_under_a_decorator_that_hides_the_signature():
    """transformers 5.15 wraps the Gated DeltaNet forward in ``force_accelerate_hooks``, whose wrapper takes
    ``*args, **kwargs`` and sets no ``__wrapped__``: the cache argument is read from the function it closes over."""

    def hiding(function):
        def wrapped(self, *args, **kwargs):
            return function(self, *args, **kwargs)

        return wrapped

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        return hidden_states

    assert cache_argument(hiding(forward)) == "cache_params"
    assert cache_argument(hiding(hiding(forward))) == "cache_params"
    with pytest.raises(TypeError, match="takes no cache argument"):
        cache_argument(hiding(lambda self, hidden_states: hidden_states))

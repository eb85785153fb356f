"""Every malformed input to every entry point fails early with an error that names the offending argument."""

import pytest
import torch
from support.tiny_models import VOCAB, build_model

from shared_prefix_logps import (
    UnsupportedModelError,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


P = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
C = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(prompts=P.float()), TypeError, "prompts must hold integer"),
        (dict(prompts=P[0]), ValueError, "prompts must be 2-D"),
        (dict(prompts="hello"), TypeError, "prompts must be a LongTensor"),
        (dict(completions=[[1, 2], "ab"]), TypeError, r"completions\[1\]"),
        (dict(completions=[[1, 2.5]]), TypeError, r"completions\[0\] must contain only integer"),
        (dict(prompts=P[:0]), ValueError, "prompts is empty"),
        (dict(completions=C[:0]), ValueError, "completions is empty"),
        (dict(prompts=[]), ValueError, "prompts is empty"),
        (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] is empty"),
        (dict(completions=C[:3]), ValueError, "not a multiple of the 2 prompts"),
        (dict(completions=C[:1]), ValueError, "not a multiple of the 2 prompts"),
        (dict(prompt_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"prompt_mask has shape \(2, 4\)"),
        (dict(completion_mask=torch.ones(4, 2, dtype=torch.bool)), ValueError, r"completion_mask has shape"),
        (dict(prompt_mask=torch.ones(2, 5)), TypeError, "prompt_mask must be bool or integer"),
        (dict(prompt_mask=torch.full((2, 5), 2)), ValueError, "prompt_mask must hold only 0 and 1"),
        (dict(prompt_mask=[[1] * 5] * 2), TypeError, "prompt_mask must be a tensor"),
        (dict(prompt_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])), ValueError, "prompt_mask row 1 does not"),
        (
            dict(prompt_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 1, 1]])),
            ValueError,
            "prompt_mask row 1 is not left",
        ),
        (
            dict(completion_mask=torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])),
            ValueError,
            "completion_mask row 1 is not right-padded",
        ),
        (dict(prompts=P.clone().fill_(VOCAB)), ValueError, f"prompts holds token id {VOCAB} outside"),
        (dict(prompts=P.clone().fill_(-1)), ValueError, "prompts holds token id -1 outside"),
        (dict(completions=C.clone().fill_(VOCAB + 5)), ValueError, "completions holds token id"),
        (dict(prompts=[[1, 2]], prompt_mask=torch.ones(1, 2)), ValueError, "prompt_mask must be None"),
        (dict(temperature=0.0), ValueError, "temperature must be positive"),
        (dict(temperature=float("nan")), ValueError, "temperature must be positive"),
        (dict(temperature="1"), TypeError, "temperature must be a number"),
        (dict(backend="fast"), ValueError, "backend must be one of"),
    ],
)
def test_bad_input_names_the_argument(model, kwargs, error, pattern):
    args = dict(prompts=P, completions=C)
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        compute_logps(model, args.pop("prompts"), args.pop("completions"), **args)


def test_padding_ids_outside_vocab_are_fine_under_the_mask(model):
    prompts = P.clone()
    prompts[0, :2] = -100
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    completions = C.clone()
    completions[1, 1:] = VOCAB + 7
    cmask = torch.ones(4, 3, dtype=torch.bool)
    cmask[1, 1:] = False
    with torch.no_grad():
        out = compute_logps(model, prompts, completions, prompt_mask=mask, completion_mask=cmask)
    assert torch.isfinite(out.logps).all() and (out.logps[1, 1:] == 0).all()


ONES = torch.ones(4, 8, dtype=torch.long)


def _ones_with_zero(row: int, column: int) -> torch.Tensor:
    """A (4, 8) int attention mask of ones with one zero."""
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[row, column] = 0
    return mask


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (dict(logits_to_keep=0), ValueError, "logits_to_keep must be in"),
        (dict(logits_to_keep=8), ValueError, "logits_to_keep must be in"),
        (dict(logits_to_keep=2.0), TypeError, "logits_to_keep must be an int"),
        (dict(attention_mask=None), ValueError, "attention_mask is required"),
        (dict(attention_mask=torch.ones(4, 7, dtype=torch.bool)), ValueError, "attention_mask has shape"),
        (dict(input_ids=[[1, 2, 3]]), TypeError, "input_ids must be a LongTensor"),
        # Prompt and completion parts are named as the caller's arguments and columns (no prompt_mask here).
        (
            dict(attention_mask=_ones_with_zero(1, 4)),
            ValueError,
            r"attention_mask\[:, :5\] \(the prompt columns, before the last logits_to_keep=3\) row 1 does not end",
        ),
        (
            dict(attention_mask=_ones_with_zero(2, 1)),
            ValueError,
            r"attention_mask\[:, :5\] \(the prompt columns, .*\) row 2 is not left-padded",
        ),
        (
            dict(attention_mask=_ones_with_zero(3, 5)),
            ValueError,
            r"attention_mask\[:, 5:\] \(the completion columns, the last logits_to_keep=3\) row 3 is not right",
        ),
        (
            dict(input_ids=torch.cat([P.repeat_interleave(2, 0), C.clone().fill_(VOCAB)], 1), attention_mask=ONES),
            ValueError,
            rf"input_ids\[:, 5:\] \(the completion columns, .*\) holds token id {VOCAB} outside",
        ),
        (
            dict(input_ids=torch.cat([P.repeat_interleave(2, 0).fill_(-1), C], 1), attention_mask=ONES),
            ValueError,
            r"input_ids\[:, :5\] \(the prompt columns, .*\) holds token id -1 outside",
        ),
    ],
)
def test_concatenated_bad_input(model, args, error, pattern):
    full = dict(
        input_ids=torch.cat([P.repeat_interleave(2, 0), C], 1), attention_mask=torch.ones(4, 8), logits_to_keep=3
    )
    full.update(args)
    with pytest.raises(error, match=pattern):
        compute_logps_concatenated(model, full["input_ids"], full["attention_mask"], full["logits_to_keep"])


def test_unsupported_model_type_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        compute_logps(gpt2, P, C)


def test_not_a_causal_lm():
    with pytest.raises(UnsupportedModelError, match="must be a transformers causal LM"):
        compute_logps(torch.nn.Linear(2, 2), P, C)


def test_unreproduced_logit_post_processing_is_refused():
    import transformers

    class DoubledLogits(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    reference = build_model("llama")
    odd = DoubledLogits(reference.config)
    with pytest.raises(UnsupportedModelError, match="post-processes its logits"):
        compute_logps(odd, P, C)


def test_implementation_outside_the_attention_interface_is_refused():
    model = build_model("qwen2")
    model.config._attn_implementation_internal = "my_unregistered_attention"
    with pytest.raises(UnsupportedModelError, match="attn_implementation='my_unregistered_attention'"):
        compute_logps(model, P, C)


def test_attention_softcap_under_sdpa_is_refused():
    model = build_model("gemma2")
    model.config._attn_implementation_internal = "sdpa"
    with pytest.raises(UnsupportedModelError, match="attn_implementation='eager'"):
        compute_logps(model, P, C)


def test_numpy_and_tensor_scalars_are_accepted_wherever_a_number_is(model):
    """Trainers hand over numpy scalars (configs loaded with numpy, ``np.int64`` lengths) and 0-d tensors: each gives
    exactly what the same Python number gives."""
    np = pytest.importorskip("numpy")
    completions = C.clone()
    ids, mask = torch.cat([P.repeat_interleave(2, 0), completions], 1), torch.ones(4, 8, dtype=torch.long)
    with torch.no_grad():
        for temperature in (np.float32(0.7), np.float64(0.7), np.int64(2), torch.tensor(0.5), torch.tensor(2)):
            reference = compute_logps(model, P, completions, temperature=float(temperature)).logps
            assert torch.equal(compute_logps(model, P, completions, temperature=temperature).logps, reference)
        reference = compute_logps(model, P, completions, token_budget=16).logps
        for budget in (np.int64(16), np.int32(16), torch.tensor(16)):
            assert torch.equal(compute_logps(model, P, completions, token_budget=budget).logps, reference)
        reference = compute_logps_concatenated(model, ids, mask, 3).logps
        for keep in (np.int64(3), torch.tensor(3)):
            assert torch.equal(compute_logps_concatenated(model, ids, mask, keep).logps, reference)
        lists = [[int(t) for t in row] for row in P]
        reference = compute_logps(model, lists, completions.tolist()).logps
        numpy_ids = [[np.int64(t) for t in row] for row in lists]
        tensor_ids = [[torch.tensor(t) for t in row] for row in lists]
        for prompts in (numpy_ids, tensor_ids):
            assert torch.equal(compute_logps(model, prompts, completions.tolist()).logps, reference)

    from shared_prefix_logps import chunked_backward

    loss_fn = lambda out, rows: out.logps.sum()  # noqa: E731
    model.zero_grad(set_to_none=True)
    chunked_backward(model, P, completions, loss_fn, generations_per_chunk=1)
    reference = [p.grad.clone() for p in model.parameters()]
    for chunk in (np.int64(1), torch.tensor(1)):
        model.zero_grad(set_to_none=True)
        chunked_backward(model, P, completions, loss_fn, generations_per_chunk=chunk, temperature=np.float32(1.0))
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), reference))
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(temperature=torch.tensor(0.7, requires_grad=True)), "temperature must be a constant number"),
        (dict(temperature=torch.tensor([0.7])), r"temperature must be a number, got a tensor of shape \(1,\)"),
        (dict(temperature=torch.tensor(True)), "temperature must be a number"),
        (dict(temperature=True), "temperature must be a number"),
        (dict(completions=[[1, 2], [torch.tensor(1.0)]] * 2), r"completions\[1\] must contain only integer"),
    ],
)
def test_scalars_that_are_not_numbers_are_refused(model, kwargs, pattern):
    args = dict(prompts=P, completions=C)
    args.update(kwargs)
    with pytest.raises(TypeError, match=pattern):
        compute_logps(model, args.pop("prompts"), args.pop("completions"), **args)


def test_float_scalars_are_not_counts(model):
    np = pytest.importorskip("numpy")
    ids, mask = torch.cat([P.repeat_interleave(2, 0), C], 1), torch.ones(4, 8, dtype=torch.long)
    for keep in (np.float64(3.0), torch.tensor(3.0)):
        with pytest.raises(TypeError, match="logits_to_keep must be an int"):
            compute_logps_concatenated(model, ids, mask, keep)
    with pytest.raises(ValueError, match="token_budget must be a positive int"):
        compute_logps(model, P, C, token_budget=np.float64(16.0))


# The tree entry points: rows, attention mask and score mask.


def _rows():
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    score = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    return ids, mask, score


def test_valid_tree_rows_pass(model):
    ids, mask, score = _rows()
    with torch.no_grad():
        out = compute_logps_tree(model, ids, mask, score)
    assert out.logps.shape == (2, 4)


@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (
            lambda i, m, s: (i, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool), s),
            ValueError,
            "attention_mask row 0 is not contiguous",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 0 scores column 0, which is padding",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 1 scores column 0, the row's first real token",
        ),
        (lambda i, m, s: (i, m[:, :3], s), ValueError, "attention_mask has shape"),
        (lambda i, m, s: (i, m, s[:1]), ValueError, "score_mask has shape"),
        (lambda i, m, s: (i, None, s), ValueError, "attention_mask is required"),
        (lambda i, m, s: (i, m, None), ValueError, "score_mask is required"),
        (lambda i, m, s: (i.float(), m, s), TypeError, "input_ids must hold integer token ids"),
        (lambda i, m, s: (i[0], m, s), ValueError, "input_ids must be 2-D"),
        (lambda i, m, s: (i.tolist(), m, s), TypeError, "input_ids must be a LongTensor"),
        (lambda i, m, s: (i + 1000, m, s), ValueError, "input_ids holds token id"),
        (lambda i, m, s: (i, m.float(), s), TypeError, "attention_mask must be bool or integer"),
        (lambda i, m, s: (i, m, s.long() * 2), ValueError, "score_mask must hold only 0 and 1"),
    ],
)
def test_bad_tree_rows(model, change, error, pattern):
    ids, mask, score = change(*_rows())
    with pytest.raises(error, match=pattern):
        compute_logps_tree(model, ids, mask, score)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(backend="nope"), "backend must be one of"),
        (dict(temperature=0.0), "temperature must be positive"),
    ],
)
def test_bad_tree_options(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_logps_tree(model, *_rows(), **kwargs)


def _both_entries(model, ids, mask, score):
    """Each tree entry point on the same rows: compute_logps_tree's output, and chunked_backward_tree's."""
    yield lambda: compute_logps_tree(model, ids, mask, score)
    yield lambda: chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum())


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda i, m, s: (i[:, :0], m[:, :0], s[:, :0]), r"input_ids has no columns, shape \(2, 0\)"),
        (lambda i, m, s: (i.to("meta"), m, s), "input_ids is a meta tensor"),
        (lambda i, m, s: (i, m.to("meta"), s), "attention_mask is a meta tensor"),
        (lambda i, m, s: (i, m, s.to("meta")), "score_mask is a meta tensor"),
    ],
)
def test_no_columns_and_meta_tensors_are_named(model, change, pattern):
    """Zero columns used to fail with argmax's IndexError, meta tensors with 'Cannot copy out of meta tensor'."""
    for call in _both_entries(model, *change(*_rows())):
        with pytest.raises(ValueError, match=pattern):
            call()


def test_a_model_with_meta_weights_is_named():
    with torch.device("meta"):
        meta_model = build_model("llama")
    ids, mask, score = _rows()
    with pytest.raises(ValueError, match="model: LlamaForCausalLM's weights are meta tensors"):
        compute_logps_tree(meta_model, ids, mask, score)
    with pytest.raises(ValueError, match="model: LlamaForCausalLM's weights are meta tensors"):
        compute_logps(meta_model, ids[:, :2], ids[:, 2:])
    with pytest.raises(ValueError, match="prompts is a meta tensor"):
        compute_logps(build_model("llama"), ids[:, :2].to("meta"), ids[:, 2:])


@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_every_row_empty_with_gradients_gives_zeros_with_a_graph(model, backend):
    """Every row all padding, gradients on: zeros that come out of a forward of the model (as the dense forward's
    do), so that loss.backward() works and gives every parameter a zero gradient ('does not require grad' before)."""
    ids, mask, _ = _rows()
    empty = torch.zeros_like(mask)
    out = compute_logps_tree(model, ids, empty, empty, backend=backend)
    assert torch.equal(out.logps, torch.zeros(2, 4)) and out.logps.requires_grad
    out.logps.sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert all(g is not None and not g.any() for g in grads)


def test_every_row_empty_in_chunked_backward_tree_back_propagates_zeros(model):
    """chunked_backward_tree hands loss_fn the same zeros with a graph (it handed detached ones, so every
    parameter's .grad stayed None, unlike compute_logps_tree's and chunked_backward's zeros)."""
    ids, mask, _ = _rows()
    empty = torch.zeros_like(mask)
    seen = []

    def loss_fn(out, rows):
        seen.append(out.logps.requires_grad)
        return out.logps.sum()

    out = chunked_backward_tree(model, ids, empty, empty, loss_fn, rows_per_chunk=1)
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert seen == [True, True] and not out.logps.any()
    assert all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("entry", ["compute", "chunked"])
def test_reentrant_checkpointing_runs_non_reentrant(entry):
    """transformers' reentrant activation checkpointing: node calls run those layers non-reentrant and get the
    gradients of the unchecked model."""
    from support.trees import pad_rows, random_tree_rows

    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=2), 2)

    def grads(checkpointing):
        model = build_model("llama")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        if entry == "compute":
            compute_logps_tree(model, ids, mask, score).logps.sum().backward()
        else:
            chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), rows_per_chunk=2)
        return [p.grad for p in model.parameters()]

    expected, found = grads(False), grads(True)
    for want, got in zip(expected, found):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

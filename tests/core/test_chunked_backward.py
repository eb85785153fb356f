"""chunked_backward: parameter gradients equal dense autograd of the summed chunk losses, for every chunk size."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import chunked_backward, compute_logps


def _loss_weights(rows, length):
    gen = torch.Generator().manual_seed(5)
    return torch.randn(rows, length, generator=gen), torch.randn(rows, length, generator=gen)


def _check_all_chunk_sizes(model, generations, *, reference_model=None, return_entropy=True):
    reference_model = reference_model or model
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=9, completion_len=6, seed=generations)
    w_logps, w_entropy = _loss_weights(*comps.shape)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=return_entropy)

    def loss_fn(out, rows):
        loss = (out.logps * w_logps[rows]).sum()
        if out.entropy is not None:
            loss = loss + (out.entropy * w_entropy[rows]).sum()
        return loss

    dense = compute_logps(reference_model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(reference_model, loss_fn(dense, torch.arange(comps.shape[0])))
    for chunk in range(1, generations + 1):
        model.zero_grad(set_to_none=True)
        out = chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=chunk, **kwargs)
        assert not out.logps.requires_grad
        assert (out.logps - dense.logps.detach()).abs().max() <= 1e-5, chunk
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        assert max_relative_grad_error(grads, expected) <= 1e-4, chunk


@pytest.mark.parametrize("generations", [1, 4, 16])
def test_every_chunk_size_matches_dense(generations):
    _check_all_chunk_sizes(build_model("llama"), generations)


def test_with_checkpointing_and_sliding_window():
    model = build_model("mistral")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _check_all_chunk_sizes(model, 4, reference_model=build_model("mistral"))


def test_with_lora():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    randomize_lora(model)
    _check_all_chunk_sizes(model, 4, return_entropy=False)


def test_gradients_accumulate_onto_existing_grads():
    model = build_model("qwen3")
    prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=7, completion_len=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    loss_fn = lambda out, rows: out.logps.sum()
    chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=2, **kwargs)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=2, **kwargs)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(generations_per_chunk=0), ValueError, r"generations_per_chunk must be in \[1, G=4\]"),
        (dict(generations_per_chunk=5), ValueError, r"generations_per_chunk must be in \[1, G=4\]"),
        (dict(generations_per_chunk=2.0), TypeError, "generations_per_chunk must be an int"),
        (dict(generations_per_chunk=2, backend="dense"), ValueError, "backend='dense' cannot"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=5, completion_len=3)
    with pytest.raises(error, match=pattern):
        chunked_backward(
            model, prompts, comps, lambda o, r: o.logps.sum(), prompt_mask=pmask, completion_mask=cmask, **kwargs
        )


def test_loss_fn_must_return_a_scalar():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(TypeError, match="scalar tensor"):
        chunked_backward(
            model,
            prompts,
            comps,
            lambda o, r: o.logps,
            generations_per_chunk=1,
            prompt_mask=pmask,
            completion_mask=cmask,
        )


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_all_masked_leaves_a_zero_grad_on_every_parameter_like_autograd(family, chunk):
    """Every completion token masked: autograd of the summed chunk losses (one dense graph) gives every parameter a
    zero gradient, which an optimizer like Adam still steps on. chunked_backward must leave the same zero ``.grad``s,
    not None (with None the optimizer would skip those parameters)."""
    model = build_model(family)
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5, seed=1)
    cmask = torch.zeros(comps.shape, dtype=torch.bool)
    w_logps, w_entropy = _loss_weights(*comps.shape)

    def loss_fn(out, rows):
        return (out.logps * w_logps[rows]).sum() + (out.entropy * w_entropy[rows]).sum()

    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(loss_fn(dense, torch.arange(comps.shape[0])), params)
    model.zero_grad(set_to_none=True)
    out = chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=chunk, **kwargs)
    assert not out.logps.any() and not out.entropy.any()
    for (name, param), grad in zip(model.named_parameters(), expected):
        assert param.grad is not None, name
        assert torch.equal(param.grad, grad) and not param.grad.any(), name


def test_completions_without_columns_leave_zero_grads():
    model = build_model("llama")
    prompts, pmask, _, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    out = chunked_backward(
        model,
        prompts,
        torch.zeros(6, 0, dtype=torch.long),
        lambda o, r: o.logps.sum() + o.entropy.sum(),
        generations_per_chunk=2,
        prompt_mask=pmask,
        return_entropy=True,
    )
    assert out.logps.shape == (6, 0)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


class _StubEngine(torch.nn.Module):
    """The parts of DeepSpeed's engine that chunked_backward drives: ``backward`` (recording the accumulation
    boundary each backward ran at) and the boundary override."""

    def __init__(self, module, boundary=True, fp16=False):
        super().__init__()
        self.module = module
        self.boundary, self.fp16 = boundary, fp16
        self._is_gradient_accumulation_boundary = None
        self.calls = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def fp16_enabled(self):
        return self.fp16

    def gradient_accumulation_steps(self):
        return 1

    def is_gradient_accumulation_boundary(self):
        override = self._is_gradient_accumulation_boundary
        return self.boundary if override is None else override

    def set_gradient_accumulation_boundary(self, is_boundary):
        self._is_gradient_accumulation_boundary = is_boundary

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append((self.is_gradient_accumulation_boundary(), scale_wrt_gas))
        loss.backward()


@pytest.fixture
def stub_deepspeed(monkeypatch):
    import sys
    import types

    # transformers asks whether deepspeed is importable when its model modules are first imported; ask it before.
    build_model("llama")
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(DeepSpeedEngine=_StubEngine))


@pytest.mark.parametrize("boundary", [True, False])
def test_deepspeed_engine_backward_passes_accumulate_then_hit_its_boundary(stub_deepspeed, boundary):
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=4)
    weights = _loss_weights(*comps.shape)[0]
    loss_fn = lambda out, rows: (out.logps * weights[rows]).sum()
    kwargs = dict(generations_per_chunk=1, prompt_mask=pmask, completion_mask=cmask)
    chunked_backward(model, prompts, comps, loss_fn, **kwargs)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = _StubEngine(model, boundary=boundary)
    chunked_backward(engine, prompts, comps, loss_fn, **kwargs)
    # The chunks' losses reach the node calls' leaves only (a plain backward, scaled by the accumulation steps); each
    # node call's backward goes through the engine off the boundary (three completion calls, then the prompts'),
    # already scaled, and a one-token forward's zero carries the step's boundary.
    assert engine.calls == [(False, False)] * 4 + [(boundary, False)]
    assert engine._is_gradient_accumulation_boundary is None
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert max_relative_grad_error(grads, expected) <= 1e-6


def test_deepspeed_engine_refusals(stub_deepspeed):
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=7, completion_len=4)
    kwargs = dict(generations_per_chunk=1, prompt_mask=pmask, completion_mask=cmask)
    loss_fn = lambda out, rows: out.logps.sum()
    with pytest.raises(NotImplementedError, match="fp16"):
        chunked_backward(_StubEngine(model, fp16=True), prompts, comps, loss_fn, **kwargs)
    # The last chunk (rows 1 and 3) has no valid token, so its loss is a constant: the step still ends at the
    # engine's boundary (the one-token forward's zero), and the override is restored.
    engine = _StubEngine(model)
    cmask[[1, 3]] = False
    chunked_backward(engine, prompts, comps, lambda out, rows: out.logps[out.mask].sum(), **kwargs)
    assert engine.calls[-1] == (True, False) and engine._is_gradient_accumulation_boundary is None
    # Parameters a DeepSpeed engine manages, passed without the engine.
    model.lm_head.weight.ds_id = 0
    with pytest.raises(ValueError, match="pass the engine itself"):
        chunked_backward(model, prompts, comps, loss_fn, **kwargs)


@pytest.mark.parametrize(
    "loss_fn",
    [lambda out, rows: out.logps.sum().detach(), lambda out, rows: torch.tensor(0.0)],
    ids=["detached", "constant"],
)
def test_loss_without_grad_is_refused_not_skipped(loss_fn):
    """A chunk with valid tokens whose loss does not require grad: ``loss.backward()`` would raise, so skipping that
    chunk's backward would leave every parameter without its gradient and say nothing."""
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(RuntimeError, match=r"chunk of rows \[0, 2\] has valid tokens but does not require grad"):
        chunked_backward(
            model, prompts, comps, loss_fn, generations_per_chunk=1, prompt_mask=pmask, completion_mask=cmask
        )
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter of the model requires grad"):
        chunked_backward(
            model,
            prompts,
            comps,
            lambda o, r: o.logps.sum(),
            generations_per_chunk=1,
            prompt_mask=pmask,
            completion_mask=cmask,
        )


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied, tied (one parameter, one buffer)
def test_head_and_embedding_gradients_are_added_into_one_buffer_each(family, monkeypatch):
    """Each backward pass adds the head's and the embedding's weight gradient into one float32 buffer per parameter
    (not a fresh (V, H) gradient per pass); the buffers reach the parameters once, and every gradient is the dense
    one."""
    from shared_prefix_logps.distributed.backward_driver import FSDP1Backward
    from shared_prefix_logps.engine import weight_grads
    from shared_prefix_logps.model import prepare_model

    delivered = []
    original = weight_grads.WeightGrads.deliver

    def deliver(self):
        parameters = model.named_parameters(remove_duplicate=False)
        delivered.append({name for name, p in parameters for q, _ in self.buffers.values() if p is q})
        original(self)

    monkeypatch.setattr(weight_grads.WeightGrads, "deliver", deliver)
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=7, completion_len=5)
    weights = _loss_weights(*comps.shape)[0]
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, (dense.logps * weights).sum())
    model.zero_grad(set_to_none=True)
    loss_fn = lambda out, rows: (out.logps * weights[rows]).sum()  # noqa: E731
    chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=1, **kwargs)
    assert delivered == [{"model.embed_tokens.weight", "lm_head.weight"}]
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert max_relative_grad_error(grads, expected) <= 1e-5
    # Sharded or engine-managed parameters take autograd's own way.
    assert weight_grads.weight_grads(prepare_model(model), FSDP1Backward(model, torch.device("cpu"))) is None


def test_auto_chunking_takes_the_fewest_chunks_that_fit(monkeypatch):
    """``generations_per_chunk="auto"`` (the default): one chunk when the prompts' and every completion's tokens fit
    the token budget (with flex then one model call for the whole step), the most generations that fit otherwise;
    gradients exact either way."""
    from shared_prefix_logps.engine import walk
    from shared_prefix_logps.inputs import group_batch
    from shared_prefix_logps.model import prepare_model
    from shared_prefix_logps.training import auto_generations_per_chunk

    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 4, prompt_len=9, completion_len=6, seed=3)
    batch = group_batch(prompts, comps, pmask, cmask, model=prepare_model(model))
    tokens = int(pmask.sum()) + int(cmask.sum())
    assert auto_generations_per_chunk(batch, 4, tokens) == 4
    assert auto_generations_per_chunk(batch, 4, tokens - 1) < 4
    assert auto_generations_per_chunk(batch, 4, 1) == 1
    w = torch.randn(comps.shape, generator=torch.Generator().manual_seed(2))

    def loss_fn(out, rows):
        return (out.logps * w[rows]).sum()

    dense = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    expected = parameter_grads(model, loss_fn(dense, torch.arange(comps.shape[0])))
    calls = []
    original = walk.forward_call
    monkeypatch.setattr(walk, "forward_call", lambda *a, **k: calls.append(1) or original(*a, **k))
    for budget, backend, expected_calls in ((None, "flex", 1), (None, "expand", 2), (tokens - 1, "expand", 3)):
        model.zero_grad(set_to_none=True)
        calls.clear()
        kwargs = dict(prompt_mask=pmask, completion_mask=cmask, token_budget=budget, backend=backend)
        chunked_backward(model, prompts, comps, loss_fn, **kwargs)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert max_relative_grad_error(grads, expected) <= 1e-4, (budget, backend)
        assert len(calls) == expected_calls, (budget, backend, len(calls))
    with pytest.raises(ValueError, match="generations_per_chunk must be an int in \\[1, G=4\\] or 'auto'"):
        chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk="all")
    with pytest.raises(ValueError, match="token_budget sizes the chunks of generations_per_chunk='auto'"):
        chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=2, token_budget=10)


def test_accumulating_into_grad_holds_no_second_copy_of_the_gradients(monkeypatch):
    """The linear layers' backward multiplies into ``.grad`` and the small parameters are added back in one operation
    per pass (engine/grad_accumulation.py): the peak live bytes of four chunks stay at those of autograd's own
    accumulation (which adds one fresh gradient at a time), on a model whose weights outweigh its activations, so a
    second copy of its gradients would show; and the gradients are the same."""
    from shared_prefix_logps.bench.memory import LiveTensorBytes
    from shared_prefix_logps.engine import run

    model = build_model("llama", hidden=256)
    prompts, pmask, comps, cmask = make_batch(1, 4, prompt_len=4, completion_len=3, seed=1)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, generations_per_chunk=1, backend="expand")
    loss_fn = lambda out, rows: out.logps.sum()  # noqa: E731
    taken = []
    original = run.grad_accumulation
    monkeypatch.setattr(run, "grad_accumulation", lambda *args, **kw: taken.append(original(*args, **kw)) or taken[-1])
    chunked_backward(model, prompts, comps, loss_fn, **kwargs)  # the head check outside the measurement
    assert taken and taken[-1] is not None and taken[-1].linears, "the accumulation was not taken"
    accumulated = {}
    for way in ("accumulating", "autograd"):
        if way == "autograd":
            monkeypatch.setattr(run, "grad_accumulation", lambda *args, **kw: None)
        model.zero_grad(set_to_none=True)
        tracker = LiveTensorBytes()
        with tracker:
            chunked_backward(model, prompts, comps, loss_fn, **kwargs)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        accumulated[way] = tracker.peak, grads
    (peak, grads), (autograd_peak, autograd_grads) = accumulated["accumulating"], accumulated["autograd"]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    assert autograd_peak > grad_bytes  # the measurement sees the gradients
    assert peak <= autograd_peak + 0.05 * layer_bytes, (peak, autograd_peak, layer_bytes)
    assert max_relative_grad_error(grads, autograd_grads) <= 1e-5

"""linear_logps (chunked lm_head + log-softmax-gather) vs a float64 reference, on both statistics backends."""

import pytest
import torch
from support.triton_cpu import IMPLEMENTATIONS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shared_prefix_logps.kernels.fused_head import default_chunk_size, linear_logps

SHAPES = [(37, 1013, 48), (5, 257, 16), (1, 3, 8)]  # (N, V, H)


def plain_head(hidden, weight, bias, targets, temperature=1.0, softcap=None, ignore_index=-100, stats_dtype=None):
    """The conventional head: full logits, log_softmax, gather. float64 inputs give the reference; low-precision
    inputs (with ``stats_dtype=torch.float32``) give the yardstick every bf16 model is trained with today."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    if stats_dtype is not None:
        logits = logits.to(stats_dtype)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lsm = (logits / temperature).log_softmax(-1)
    valid = targets != ignore_index
    logp = lsm.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def run(fn, hidden, weight, bias, targets, dtype, return_entropy=True):
    """Forward + backward with fixed random upstream gradients; returns outputs and input gradients (float64)."""
    gen = torch.Generator().manual_seed(1)
    g_lp = torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    leaves = [t.to(dtype).clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    lp, ent = fn(*leaves)
    loss = (lp * g_lp.to(lp.dtype)).sum()
    if return_entropy:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    loss.backward()
    out = {"logps": lp, "entropy": ent if return_entropy else None}
    for name, leaf in zip(("hidden", "weight", "bias"), leaves):
        out["d_" + name] = leaf.grad if leaf is not None else None
    return out


def errors(ours, ref):
    """Max abs error of outputs and max error relative to the reference's max magnitude for gradients."""
    errs = {}
    for key, r in ref.items():
        if r is None or ours.get(key) is None:
            continue
        e = (ours[key].double() - r.double()).abs().max().item()
        errs[key] = e / r.abs().max().item() if key.startswith("d_") else e
    return errs


def make_inputs(n, v, h, *, seed, bias=True, weight_scale=0.25, ignore=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * weight_scale
    b = torch.randn(v, generator=gen) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore and n > 2:
        targets[1] = -100
        targets[n - 1] = -100
    return hidden, weight, b, targets


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_fp32_matches_float64(implementation, shape, temperature, softcap, return_entropy):
    n, v, h = shape
    hidden, weight, bias, targets = make_inputs(n, v, h, seed=n + v, bias=n == 37)
    kw = {"temperature": temperature, "softcap": softcap}

    def ours(hd, w, b):
        out = linear_logps(
            hd, w, targets, bias=b, return_entropy=return_entropy, chunk_size=8, implementation=implementation, **kw
        )
        return out if return_entropy else (out, None)

    got = run(ours, hidden, weight, bias, targets, torch.float32, return_entropy)
    ref = run(
        lambda hd, w, b: plain_head(hd, w, b, targets, **kw),
        hidden,
        weight,
        bias,
        targets,
        torch.float64,
        return_entropy,
    )
    assert got["logps"].dtype == torch.float32 and (got["logps"] <= 0).all()
    if return_entropy:
        assert got["entropy"].dtype == torch.float32
    assert got["d_hidden"].dtype == torch.float32 and got["d_weight"].dtype == torch.float32
    errs = errors(got, ref)
    assert errs["logps"] < 1e-5, errs
    if return_entropy:
        assert errs["entropy"] < 1e-5, errs
    for key in ("d_hidden", "d_weight", "d_bias"):
        if key in errs:
            assert errs[key] < 1e-4, errs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_against_float64_of_same_values(implementation, temperature, softcap):
    n, v, h = 37, 1013, 48
    hidden, weight, _, targets = make_inputs(n, v, h, seed=23, bias=False, weight_scale=0.3)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()  # the reference sees exactly these values, upcast
    kw = {"temperature": temperature, "softcap": softcap}

    def ours(hd, w, b):
        return linear_logps(hd, w, targets, return_entropy=True, chunk_size=16, implementation=implementation, **kw)

    got = run(ours, hidden, weight, None, targets, torch.bfloat16)
    ref = run(lambda hd, w, b: plain_head(hd, w, b, targets, **kw), hidden, weight, None, targets, torch.float64)
    yardstick = run(
        lambda hd, w, b: plain_head(hd, w, b, targets, stats_dtype=torch.float32, **kw),
        hidden,
        weight,
        None,
        targets,
        torch.bfloat16,
    )
    assert got["logps"].dtype == torch.float32 and (got["logps"] <= 0).all()
    assert got["d_hidden"].dtype == torch.bfloat16 and got["d_weight"].dtype == torch.bfloat16
    errs, yard = errors(got, ref), errors(yardstick, ref)
    # Each logit leaves the bf16 matmul rounded by at most half an ulp (2^-9 relative); a log-prob moves by at most
    # twice the largest logit error: the target's and the normaliser's.
    ref_logits = (hidden.double() @ weight.double().t()).abs().amax(-1) / temperature
    bound = 2 * 2.0**-9 * ref_logits + 1e-5
    lp_err = (got["logps"].double() - ref["logps"]).abs()
    assert (lp_err <= bound).all(), (lp_err - bound).max()
    # And nothing worse than the conventional bf16 head: the statistics themselves add only float32 noise; the
    # gradients add one extra rounding of d logits to bf16 (truncation under the interpreter).
    for key, slack in (("logps", 1e-5), ("entropy", 1e-4), ("d_hidden", 2e-3), ("d_weight", 2e-3)):
        assert errs[key] <= 1.25 * yard[key] + slack, (key, errs, yard)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_extreme_logits(implementation, temperature):
    # H = 1 with exactly representable products: logits of exactly +-1e4 (and +-5e3), so the float64 reference
    # sees the same logits and any error is the head's own.
    v = 1013
    gen = torch.Generator().manual_seed(29)
    weight = torch.tensor([1.0, -1.0, 0.5])[torch.randint(0, 3, (v, 1), generator=gen)]
    hidden = torch.tensor([[1e4], [-1e4], [1e4], [3e3], [-1e4]])
    targets = torch.tensor([0, 0, 0, 0, 0])
    targets[0] = int((weight[:, 0] == 1.0).nonzero()[0])  # dominant target: log-prob -log(count) or 0
    targets[1] = int((weight[:, 0] == 1.0).nonzero()[0])  # no mass at all: about -2e4 / T
    targets[2] = int((weight[:, 0] == 0.5).nonzero()[0])
    targets[4] = int((weight[:, 0] == -1.0).nonzero()[0])
    weight[0, 0] = 1.25  # a unique maximum for hidden row 0 if the target is row 0's argmax
    targets[0] = 0

    def ours(hd, w, b):
        return linear_logps(hd, w, targets, temperature=temperature, return_entropy=True, implementation=implementation)

    got = run(ours, hidden, weight, None, targets, torch.float32)
    ref = run(lambda hd, w, b: plain_head(hd, w, b, targets, temperature), hidden, weight, None, targets, torch.float64)
    for key in ("logps", "entropy", "d_hidden", "d_weight"):
        assert torch.isfinite(got[key]).all(), key
    assert (got["logps"] <= 0).all() and got["logps"][0].item() == 0.0
    assert torch.allclose(got["logps"].double(), ref["logps"], rtol=1e-6, atol=1e-5)
    errs = errors(got, ref)
    assert errs["entropy"] < 1e-5 and errs["d_hidden"] < 1e-4 and errs["d_weight"] < 1e-4, errs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_masked_rows_are_skipped_before_the_matmul(implementation):
    n, v, h = 37, 1013, 8
    hidden, weight, bias, targets = make_inputs(n, v, h, seed=31, ignore=False)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[[0, 5, 6, 20, 36]] = True
    targets = torch.where(keep, targets, torch.full_like(targets, -5))
    hidden[~keep] = float("nan")  # compacted away, so it can never reach an output or a gradient

    def ours(hd, w, b):
        return linear_logps(hd, w, targets, bias=b, return_entropy=True, ignore_index=-5, implementation=implementation)

    with ShapeRecorder() as rec:
        got = run(ours, hidden, weight, bias, targets, torch.float32)
    assert max(s[0] for s in rec.vocab_shapes(v)) == int(keep.sum())  # only valid rows ever met the vocabulary
    assert (got["logps"][~keep] == 0).all() and (got["entropy"][~keep] == 0).all()
    assert (got["d_hidden"][~keep] == 0).all()
    for key in ("logps", "entropy", "d_hidden", "d_weight", "d_bias"):
        assert torch.isfinite(got[key]).all(), key
    # The dense reference does compute masked rows, so give it finite ones there.
    finite_hidden = torch.where(keep[:, None], hidden, torch.zeros_like(hidden))
    ref = run(
        lambda hd, w, b: plain_head(hd, w, b, targets, ignore_index=-5),
        finite_hidden,
        weight,
        bias,
        targets,
        torch.float64,
    )
    errs = errors(got, ref)
    assert errs["logps"] < 1e-5 and errs["entropy"] < 1e-5, errs
    assert errs["d_hidden"] < 1e-4 and errs["d_weight"] < 1e-4 and errs["d_bias"] < 1e-4, errs

    # Nothing valid at all: zeros, and backward still runs and gives zero gradients.
    none = torch.full((4,), -100)
    hd = torch.randn(4, h, requires_grad=True)
    w = weight.clone().requires_grad_()
    lp, ent = linear_logps(hd, w, none, return_entropy=True, implementation=implementation)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (4,) and (lp == 0).all() and (ent == 0).all()
    assert (hd.grad == 0).all() and (w.grad == 0).all()


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op produces (views included, flagged)."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.nbytes = []
        self.new_shapes = []  # outputs of non-view ops: tensors with storage of their own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        shapes = [tuple(t.shape) for t in tensors]
        self.shapes.extend(shapes)
        self.nbytes.extend(t.numel() * t.element_size() for t in tensors)
        if not func.is_view:
            self.new_shapes.extend(shapes)
        return out

    def vocab_shapes(self, v):
        """Allocated (rows, V) tensors: logits-like buffers (the transposed weight is a view, so not counted)."""
        return [s for s in self.new_shapes if len(s) == 2 and s[1] == v]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_never_materialises_more_than_one_chunk_of_logits(implementation, softcap):
    n, v, h, chunk = 37, 1013, 8, 10  # h < chunk, so even the (V, H) weight gradient is below one chunk
    hidden, weight, bias, targets = make_inputs(n, v, h, seed=37)
    hidden.requires_grad_()
    weight.requires_grad_()
    bias.requires_grad_()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with ShapeRecorder() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = linear_logps(
            hidden,
            weight,
            targets,
            bias=bias,
            softcap=softcap,
            return_entropy=True,
            chunk_size=chunk,
            implementation=implementation,
        )
    with ShapeRecorder() as bwd:
        (lp.sum() + ent.sum()).backward()
    for rec in (fwd, bwd):
        assert rec.shapes, "the dispatch mode saw nothing"
        # Sizes in bytes, against one chunk of float32 logits: the Triton interpreter views storages as uint8.
        assert max(rec.nbytes) <= chunk * v * 4
        assert (chunk, v) in rec.vocab_shapes(v)  # chunk-sized logits do occur: the check above is not vacuous
    # What autograd keeps between forward and backward: inputs and per-token statistics, no logits.
    assert all(s in {(v, h), (v,)} or v not in s for s in saved), saved


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_chunking_does_not_change_results(implementation):
    hidden, weight, bias, targets = make_inputs(37, 257, 16, seed=41)
    outs = []
    for chunk in (1, 7, 37, None):
        fn = lambda hd, w, b, c=chunk: linear_logps(  # noqa: E731
            hd, w, targets, bias=b, temperature=0.7, return_entropy=True, chunk_size=c, implementation=implementation
        )
        outs.append(run(fn, hidden, weight, bias, targets, torch.float32))
    for other in outs[1:]:
        errs = errors(other, outs[0])
        assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_kept_logits_and_a_weight_gradient_buffer_change_no_result(implementation, softcap):
    """Logits kept from forward (no recomputation in backward) give the recomputed path's numbers; a weight gradient
    added into the caller's buffer, over two backward passes, is the sum autograd gives, and autograd gets none."""
    hidden, weight, bias, targets = make_inputs(37, 257, 16, seed=47)
    outs = []
    for keep in (0, 10**9):
        fn = lambda hd, w, b, k=keep: linear_logps(  # noqa: E731
            hd, w, targets, bias=b, softcap=softcap, return_entropy=True, chunk_size=7, keep_logits_bytes=k,
            implementation=implementation,
        )  # fmt: skip
        outs.append(run(fn, hidden, weight, bias, targets, torch.float32))
    errs = errors(outs[1], outs[0])
    assert max(errs.values()) < 1e-6, errs
    w = weight.clone().requires_grad_()
    expected = torch.zeros_like(weight)
    buffer = torch.zeros(weight.shape, dtype=torch.float32)
    for scale in (1.0, -0.5):
        hd = hidden.clone().requires_grad_()
        (scale * linear_logps(hd, w, targets, implementation=implementation)).sum().backward()
        expected += w.grad
        w.grad = None
        out = linear_logps(hd, w, targets, implementation=implementation, weight_grad=buffer)
        (scale * out).sum().backward()
        assert w.grad is None and hd.grad is not None
    assert (buffer - expected).abs().max() < 1e-6


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_leading_dims_and_partial_requires_grad(implementation):
    hidden, weight, _, targets = make_inputs(12, 257, 16, seed=43, bias=False)
    hidden3, targets3 = hidden.view(3, 4, 16), targets.view(3, 4)
    lp = linear_logps(hidden3, weight, targets3, implementation=implementation)
    ref, _ = plain_head(hidden.double(), weight.double(), None, targets)
    assert lp.shape == (3, 4) and (lp.reshape(-1).double() - ref).abs().max() < 1e-5

    # Frozen weight (LoRA-style): only the hidden states get a gradient, and vice versa.
    hd = hidden.clone().requires_grad_()
    linear_logps(hd, weight, targets, implementation=implementation).sum().backward()
    assert hd.grad is not None and torch.isfinite(hd.grad).all()
    w = weight.clone().requires_grad_()
    linear_logps(hidden, w, targets, implementation=implementation).sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_autocast_computes_like_the_models_lm_head(implementation):
    hidden, weight, bias, targets = make_inputs(37, 257, 16, seed=59)
    as_bf16 = run(
        lambda hd, w, b: linear_logps(hd, w, targets, bias=b, return_entropy=True, implementation=implementation),
        hidden,
        weight,
        bias,
        targets,
        torch.bfloat16,
    )

    def under_autocast(hd, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear_logps(hd, w, targets, bias=b, return_entropy=True, implementation=implementation)

    got = run(under_autocast, hidden, weight, bias, targets, torch.float32)
    assert torch.equal(got["logps"], as_bf16["logps"]) and torch.equal(got["entropy"], as_bf16["entropy"])
    for key in ("d_hidden", "d_weight", "d_bias"):
        assert got[key].dtype == torch.float32  # gradients reach the float32 leaves in their dtype
        assert torch.equal(got[key].bfloat16(), as_bf16[key]), key


def test_default_chunk_size_follows_the_memory_budget():
    assert default_chunk_size(10**6, 151936) == (256 * 2**20) // (4 * 151936)
    assert default_chunk_size(10**6, 10**9) == 1
    assert default_chunk_size(5, 1000) == 5


def test_default_chunk_size_on_gpus_comes_from_available_memory():
    cuda = torch.device("cuda", 0)
    gib = 2**30
    # An eighth of 80 GiB available = 10 GiB, capped at 8 GiB: 14,128 rows at V=151936, rounded down to 14,080 (x128).
    rows = default_chunk_size(10**6, 151936, device=cuda, available_bytes=80 * gib)
    assert rows == (8 * gib // (4 * 151936)) // 128 * 128 == 14080
    # Little available memory: the 512 MiB floor, still a multiple of 128.
    assert default_chunk_size(10**6, 151936, device=cuda, available_bytes=gib) == 768
    # Fewer rows than a chunk: all of them, not rounded.
    assert default_chunk_size(1000, 151936, device=cuda, available_bytes=80 * gib) == 1000
    # An explicit budget wins; CPU keeps its fixed budget.
    assert default_chunk_size(10**6, 1000, 4 * 1000 * 300, device=cuda, available_bytes=80 * gib) == 256
    assert default_chunk_size(10**6, 151936, device=torch.device("cpu")) == (256 * 2**20) // (4 * 151936)


def _simulated_cuda_device(monkeypatch, *, free, reserved, allocated):
    """torch.cuda's memory queries answering for an 80 GiB device in the given state (bytes)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_gpu_chunk_is_thousands_of_rows_and_the_same_after_a_first_step(monkeypatch):
    """cudaMemGetInfo counts the caching allocator's reserve as used. On an 80 GiB device with 10 GiB live, a first
    step sees 66 GiB free and 2 GiB cached; once that step has grown the reserve to 70 GiB, only 8 GiB are free but
    62 GiB are cached: the same 68 GiB are available to the head's chunk in both steps."""
    gib, vocab, cuda = 2**30, 151936, torch.device("cuda", 0)
    _simulated_cuda_device(monkeypatch, free=66 * gib, reserved=12 * gib, allocated=10 * gib)
    first_step = default_chunk_size(10**6, vocab, device=cuda)
    _simulated_cuda_device(monkeypatch, free=8 * gib, reserved=70 * gib, allocated=10 * gib)
    later_steps = default_chunk_size(10**6, vocab, device=cuda)
    assert first_step == later_steps == 14080  # 68 GiB / 8 = 8.5 GiB, capped at 8 GiB
    # Most of the device reserved but free: still thousands of rows, a multiple of 128.
    _simulated_cuda_device(monkeypatch, free=1 * gib, reserved=75 * gib, allocated=45 * gib)
    rows = default_chunk_size(10**6, vocab, device=cuda)
    assert rows >= 4096 and rows % 128 == 0, rows


def test_rejects_bad_arguments():
    hidden, weight, _, targets = make_inputs(4, 17, 8, seed=47, bias=False)
    with pytest.raises(ValueError):
        linear_logps(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError):
        linear_logps(hidden, weight, targets, softcap=-1.0)
    with pytest.raises(ValueError):
        linear_logps(hidden, weight, targets[:3])
    with pytest.raises(ValueError):
        linear_logps(hidden, weight.t(), targets)
    with pytest.raises(ValueError):
        linear_logps(hidden, weight, targets, implementation="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cuda_bf16_matches_float64(softcap, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    n, v, h = 513, 32011, 256
    hidden, weight, _, targets = make_inputs(n, v, h, seed=53, bias=False, weight_scale=0.1)
    hidden, weight, targets = hidden.bfloat16().cuda(), weight.bfloat16().cuda(), targets.cuda()
    kw = {"temperature": 0.7, "softcap": softcap}

    def ours(hd, w, b):
        return linear_logps(hd, w, targets, return_entropy=True, chunk_size=128, implementation="triton", **kw)

    got = run(ours, hidden, weight, None, targets, torch.bfloat16)
    ref = run(lambda hd, w, b: plain_head(hd, w, b, targets, **kw), hidden, weight, None, targets, torch.float64)
    yardstick = run(
        lambda hd, w, b: plain_head(hd, w, b, targets, stats_dtype=torch.float32, **kw),
        hidden,
        weight,
        None,
        targets,
        torch.bfloat16,
    )
    errs, yard = errors(got, ref), errors(yardstick, ref)
    assert (got["logps"] <= 0).all()
    for key in ("logps", "entropy", "d_hidden", "d_weight"):
        assert errs[key] <= 1.5 * yard[key] + 1e-3, (key, errs, yard)


def test_backend_is_the_deprecated_name_of_implementation():
    """``backend=`` (the kernels' earlier name for the implementation) still works, warns, and cannot be combined."""
    from shared_prefix_logps.kernels import logsoftmax_gather

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    targets = torch.randint(0, 11, (5,), generator=gen)
    expected = linear_logps(hidden, weight, targets, implementation="torch")
    with pytest.warns(DeprecationWarning, match="implementation"):
        old = linear_logps(hidden, weight, targets, backend="torch")
    torch.testing.assert_close(old, expected, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="implementation"):
        old = logsoftmax_gather(hidden @ weight.T, targets, backend="torch")
    torch.testing.assert_close(old, logsoftmax_gather(hidden @ weight.T, targets, implementation="torch"))
    with pytest.raises(TypeError, match="implementation"):
        linear_logps(hidden, weight, targets, implementation="torch", backend="torch")


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_chunk_buffers_fill_the_chunk_budget_and_stay_within_it(dtype, softcap, monkeypatch):
    """The chunk size picked without ``chunk_size`` bounds what backward really holds per chunk, with statistics
    that work in the logits' buffer as the Triton kernel does (a stand-in here: the interpreter copies its arguments,
    which a GPU launch does not): with a softcap the float32 capped logits and tanh (8 bytes a logit) no longer take
    twice the budget (10 bytes a logit in bfloat16, the matmul's output alive beside both); without one a bfloat16
    chunk no longer uses half of it (2 bytes a logit, sized as if 4)."""
    from shared_prefix_logps.bench.memory import LiveTensorBytes
    from shared_prefix_logps.kernels import fused_head

    def in_place_statistics_backward(logits, *args):
        return logits.mul_(0.5)  # the kernel's contract with inplace=True: d logits written over the logits

    budget, n, vocab, width = 2**20, 512, 4096, 8
    monkeypatch.setattr(fused_head, "DEFAULT_CHUNK_BYTES", budget)
    monkeypatch.setattr(fused_head, "stats_backward", in_place_statistics_backward)
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, width, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    logps = linear_logps(hidden, weight, targets, softcap=softcap, implementation="torch")
    tracker = LiveTensorBytes()
    with tracker:
        logps.sum().backward()
    # Beside the chunks: the float32 weight gradient and the hidden states' gradient; in half precision also the
    # weight gradient's copy at the end and, on CPU, each chunk's (V, H) product before it joins the float32 sum.
    half = dtype.itemsize < 4
    fixed = vocab * width * 4 + n * width * dtype.itemsize + (2 * vocab * width * dtype.itemsize if half else 0)
    chunk_peak = tracker.peak - fixed
    assert 0.75 * budget <= chunk_peak <= 1.05 * budget, (chunk_peak / budget, tracker.peak)

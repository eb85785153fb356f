"""logsoftmax_gather (Triton kernels under TRITON_INTERPRET=1, and the torch fallback) vs a float64 reference."""

import pytest
import torch
from support.triton_cpu import IMPLEMENTATIONS, TRITON_OK

from shared_prefix_logps.kernels import implementation as kernel_implementation
from shared_prefix_logps.kernels import logsoftmax_gather, resolve_implementation

SHAPES = [(37, 1013), (5, 257), (1, 3)]


def reference(logits, targets, temperature=1.0, ignore_index=-100):
    """float64 log_softmax + gather and entropy of the same values; differentiable w.r.t. ``logits``."""
    z = logits.double() / temperature
    lsm = z.log_softmax(-1)
    valid = targets != ignore_index
    logp = lsm.gather(-1, targets.clamp(0, z.shape[-1] - 1)[..., None]).squeeze(-1)
    # H = lse - E[z], with masked (-inf) entries zeroed so that neither H nor its gradient sees 0 * inf.
    z_finite = torch.where(torch.isinf(z), torch.zeros_like(z), z)
    entropy = torch.logsumexp(z, -1) - (lsm.exp() * z_finite).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def check_against_reference(logits, targets, implementation, *, temperature=1.0, return_entropy=True, **kw):
    """Run op and reference with the same random upstream gradients; return (ours, ref) pairs and logps."""
    gen = torch.Generator().manual_seed(1)
    g_lp = torch.randn(targets.shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(targets.shape, generator=gen, dtype=torch.float64)

    x_ref = logits.detach().double().requires_grad_()
    lp_ref, ent_ref = reference(x_ref, targets, temperature, kw.get("ignore_index", -100))
    loss_ref = (lp_ref * g_lp).sum() + ((ent_ref * g_ent).sum() if return_entropy else 0)
    loss_ref.backward()

    x = logits.detach().clone().requires_grad_()
    out = logsoftmax_gather(
        x, targets, temperature=temperature, return_entropy=return_entropy, implementation=implementation, **kw
    )
    lp, ent = out if return_entropy else (out, None)
    loss = (lp * g_lp.float()).sum() + ((ent * g_ent.float()).sum() if return_entropy else 0)
    loss.backward()
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert (lp <= 0).all(), f"positive log-prob {lp.max().item()}"
    return {"logps": (lp, lp_ref), "entropy": (ent, ent_ref), "grad": (x.grad, x_ref.grad)}


def max_err(pair):
    ours, ref = pair
    return (ours.double() - ref.double()).abs().max().item()


def make_targets(n, v, gen, ignore=True):
    t = torch.randint(0, v, (n,), generator=gen)
    if ignore and n > 2:
        t[1] = -100
        t[n - 1] = -100
    return t


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_fp32_matches_float64(implementation, shape, temperature, return_entropy):
    n, v = shape
    gen = torch.Generator().manual_seed(n * v)
    logits = torch.randn(n, v, generator=gen) * 4
    targets = make_targets(n, v, gen)
    res = check_against_reference(
        logits, targets, implementation, temperature=temperature, return_entropy=return_entropy
    )
    assert max_err(res["logps"]) < 1e-5
    if return_entropy:
        assert res["entropy"][0].dtype == torch.float32
        assert max_err(res["entropy"]) < 1e-5
    grad, grad_ref = res["grad"]
    assert grad.dtype == torch.float32
    assert max_err(res["grad"]) <= 1e-4 * grad_ref.abs().max().item()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_half_input_matches_float64_of_same_values(implementation, dtype, temperature):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 1013, generator=gen) * 4).to(dtype)
    targets = make_targets(37, 1013, gen)
    res = check_against_reference(logits, targets, implementation, temperature=temperature)
    # The kernels upcast each element exactly and accumulate in float32: float32-level agreement is expected.
    assert max_err(res["logps"]) < 1e-5
    assert max_err(res["entropy"]) < 1e-5
    # d logits is stored in the input dtype: within one ulp of the exact value (the interpreter truncates instead of
    # rounding, hence one ulp, not half), plus float32 noise and, for fp16, its subnormal spacing.
    grad, grad_ref = res["grad"]
    assert grad.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    floor = 1e-6 * grad_ref.abs().max().item() + (6e-8 if dtype == torch.float16 else 0.0)
    excess = (grad.double() - grad_ref).abs() - (ulp * grad_ref.abs() + floor)
    assert excess.max().item() <= 0, f"max excess {excess.max().item()}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_extreme_logits(implementation, temperature):
    v = 1013
    gen = torch.Generator().manual_seed(5)
    logits = torch.full((6, v), -1e4)
    targets = torch.randint(0, v, (6,), generator=gen)
    logits[0, targets[0]] = 1e4  # target holds all the mass: log-prob must be exactly 0, not positive
    logits[1] = 1e4
    logits[1, targets[1]] = -1e4  # target has no mass: huge negative log-prob, still finite
    logits[2] = torch.where(torch.rand(v, generator=gen) < 0.5, 1e4, -1e4)
    logits[3] = 1e4  # uniform at a large offset: log-prob = -log V
    logits[4] = torch.randn(v, generator=gen) + 1e4
    logits[5] = torch.randn(v, generator=gen) * 1e4
    logits[5, :7] = float("-inf")  # a vocabulary mask: zero probability, no nan
    targets[5] = 11
    res = check_against_reference(logits, targets, implementation, temperature=temperature)
    lp, lp_ref = res["logps"]
    assert torch.isfinite(lp).all() and torch.isfinite(res["entropy"][0]).all()
    assert torch.isfinite(res["grad"][0]).all()
    assert lp[0].item() == 0.0
    assert torch.allclose(lp.double(), lp_ref, rtol=1e-6, atol=1e-5), max_err(res["logps"])
    assert max_err(res["entropy"]) < 1e-5
    assert max_err(res["grad"]) < 1e-5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_log_probs_never_positive(implementation):
    # A dominant target just barely below/above numerical certainty: float32 rounding without the clamp
    # produces tiny positive log-probs here.
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 257, generator=gen) * 3
    targets = torch.randint(0, 257, (64,), generator=gen)
    margin = torch.linspace(10.0, 40.0, 64)
    logits[torch.arange(64), targets] = logits.max(-1).values + margin
    lp = logsoftmax_gather(logits, targets, implementation=implementation)
    assert (lp <= 0).all()
    lp_ref, _ = reference(logits, targets)
    assert max_err((lp, lp_ref)) < 1e-6


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_ignored_rows_are_exact_zeros_and_never_read(implementation):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 257, generator=gen)
    logits[2] = float("nan")  # garbage in an ignored row must not leak anywhere
    logits[4] = 1e30
    targets = torch.tensor([3, 5, -7, 200, -7])
    x = logits.clone().requires_grad_()
    lp, ent = logsoftmax_gather(x, targets, return_entropy=True, ignore_index=-7, implementation=implementation)
    (lp.sum() + ent.sum()).backward()
    assert lp[2].item() == 0.0 and lp[4].item() == 0.0 and ent[2].item() == 0.0 and ent[4].item() == 0.0
    assert (x.grad[2] == 0).all() and (x.grad[4] == 0).all()
    valid = torch.tensor([0, 1, 3])
    ref = check_against_reference(logits[valid], targets[valid], implementation)
    assert torch.equal(lp[valid], ref["logps"][0])
    assert torch.isfinite(x.grad).all()

    none_valid = torch.full((3,), -100)
    x = torch.randn(3, 257, requires_grad=True)
    lp = logsoftmax_gather(x, none_valid, implementation=implementation)
    lp.sum().backward()
    assert (lp == 0).all() and (x.grad == 0).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["row_strided", "column_strided"])
def test_non_contiguous_logits(implementation, layout):
    gen = torch.Generator().manual_seed(11)
    n, v = 37, 1013
    if layout == "row_strided":
        logits = (torch.randn(n, v + 29, generator=gen) * 4)[:, 13 : 13 + v]  # row stride v + 29
        assert logits.stride() == (v + 29, 1)
    else:
        logits = (torch.randn(v, n, generator=gen) * 4).t()  # vocabulary not unit-strided
    targets = make_targets(n, v, gen)
    res = check_against_reference(logits, targets, implementation, temperature=0.7)
    assert max_err(res["logps"]) < 1e-5
    assert max_err(res["entropy"]) < 1e-5
    assert max_err(res["grad"]) <= 1e-4 * res["grad"][1].abs().max().item()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout", ["contiguous", "row_strided"])
def test_inplace_backward_overwrites_logits(implementation, layout):
    gen = torch.Generator().manual_seed(13)
    n, v = 37, 1013
    base = torch.randn(n, v + (5 if layout == "row_strided" else 0), generator=gen) * 4
    targets = make_targets(n, v, gen)
    leaf = base.clone().requires_grad_()
    logits = (leaf * 1.0)[:, :v]  # a temporary the caller does not need after the op
    lp, ent = logsoftmax_gather(
        logits, targets, return_entropy=True, inplace_backward=True, implementation=implementation
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    x_ref = base[:, :v].double().requires_grad_()
    lp_ref, ent_ref = reference(x_ref, targets)
    (lp_ref.sum() + 0.5 * ent_ref.sum()).backward()
    assert max_err((leaf.grad[:, :v], x_ref.grad)) <= 1e-4 * x_ref.grad.abs().max().item()
    # The buffer now holds d logits: proof the gradient was written in place, not into a new (N, V) tensor.
    assert torch.equal(logits.detach(), leaf.grad[:, :v])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_leading_dims(implementation):
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(3, 4, 257, generator=gen)
    targets = torch.randint(0, 257, (3, 4), generator=gen)
    targets[1, 2] = -100
    res = check_against_reference(logits, targets, implementation)
    assert res["logps"][0].shape == (3, 4) and res["entropy"][0].shape == (3, 4)
    assert max_err(res["logps"]) < 1e-5
    assert max_err(res["grad"]) <= 1e-4 * res["grad"][1].abs().max().item()


@pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")
def test_out_of_range_target_is_nan_on_triton():
    logits = torch.randn(3, 257)
    lp = logsoftmax_gather(logits, torch.tensor([0, 257, -1]), implementation="triton")
    assert lp[0].item() <= 0 and torch.isnan(lp[1:]).all()


def test_backend_selection(monkeypatch):
    cpu = torch.empty(2, 3)
    with pytest.raises(ValueError):
        resolve_implementation("cuda", cpu)
    assert resolve_implementation("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # CPU tensors without the interpreter: auto falls back to torch, a forced Triton refuses.
    assert resolve_implementation("auto", cpu) == "torch"
    with pytest.raises(RuntimeError):
        logsoftmax_gather(cpu, torch.tensor([0, 1]), implementation="triton")
    lp = logsoftmax_gather(cpu.normal_(), torch.tensor([0, 1]))
    assert torch.allclose(lp.double(), reference(cpu, torch.tensor([0, 1]))[0])
    if TRITON_OK:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_implementation("auto", cpu) == "triton"


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        logsoftmax_gather(torch.randn(2, 5), torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError):
        logsoftmax_gather(torch.randn(2, 5), torch.tensor([0, 1, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_float64(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(19)
    n, v = 257, 151936
    logits = (torch.randn(n, v, generator=gen) * 4).to(dtype).cuda()
    targets = make_targets(n, v, gen).cuda()
    res = check_against_reference(logits, targets, "triton", temperature=0.7)
    assert max_err(res["logps"]) < 2e-5
    assert max_err(res["entropy"]) < 2e-5
    grad, grad_ref = res["grad"]
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    excess = (grad.double() - grad_ref).abs() - (ulp * grad_ref.abs() + 1e-6 * grad_ref.abs().max())
    assert excess.max().item() <= 0


@pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")
@pytest.mark.parametrize("block", [64, 128])
def test_triton_online_rescaling_over_many_blocks(block, monkeypatch):
    # The interpreter normally covers a row with one block; force 8-16 blocks so the running max, sum and entropy
    # are rescaled as the max moves, including rows whose first blocks are entirely -inf.
    monkeypatch.setattr(kernel_implementation._triton_impl, "BLOCK_V_OVERRIDE", block)
    gen = torch.Generator().manual_seed(23)
    n, v = 9, 1013
    logits = torch.randn(n, v, generator=gen) * 4
    logits[0] = torch.linspace(-50, 50, v)  # the max moves in every block
    logits[1] = torch.linspace(50, -50, v)  # the max is in the first block
    logits[2, : 3 * block] = float("-inf")  # first blocks contribute nothing; frame stays 0 until a finite logit
    logits[3] = torch.randn(v, generator=gen) * 1e4  # extreme, max anywhere
    logits[4, -1] = 1e4  # max in the last, partial block
    targets = torch.randint(3 * block, v, (n,), generator=gen)
    targets[5] = -100
    res = check_against_reference(logits, targets, "triton", temperature=0.7)
    assert torch.allclose(res["logps"][0].double(), res["logps"][1], rtol=1e-6, atol=1e-5), max_err(res["logps"])
    assert max_err(res["entropy"]) < 1e-5
    assert max_err(res["grad"]) <= 1e-4 * res["grad"][1].abs().max().item()


def _compile_for_sm90(fn, signature, constexprs, num_warps):
    """Compile a kernel to a cubin for an H100 with Triton's own toolchain; needs no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    jf = JITFunction(fn)
    src = ASTSource(jf, signature, constexprs={(jf.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_cuda_without_a_gpu(dtype):
    # The interpreter is lenient about typing (loop-carried scalars, tensor loop bounds) in ways the compiler is
    # not; compiling both kernels down to a cubin catches such errors on machines without a GPU.
    from triton.runtime.jit import JITFunction

    impl = kernel_implementation._triton_impl
    if not isinstance(impl._SUM, JITFunction):
        pytest.skip("Triton was imported with TRITON_INTERPRET=1, so its own library cannot be compiled")
    ptr = f"*{dtype}"
    common = {"n_cols": "i32", "inv_temperature": "fp32", "ignore_index": "i64", "BLOCK_V": "constexpr"}
    fwd_sig = {
        "logits_ptr": ptr,
        "logits_row_stride": "i64",
        "targets_ptr": "*i64",
        "logps_ptr": "*fp32",
        "norm_ptr": "*fp32",
        "norm_stride": "i32",
        "entropy_ptr": "*fp32",
        **common,
        "RETURN_ENTROPY": "constexpr",
    }
    bwd_sig = {
        "logits_ptr": ptr,
        "logits_row_stride": "i64",
        "grad_ptr": ptr,
        "grad_row_stride": "i64",
        "targets_ptr": "*i64",
        "norm_ptr": "*fp32",
        "norm_stride": "i32",
        "entropy_ptr": "*fp32",
        "grad_logps_ptr": "*fp32",
        "grad_entropy_ptr": "*fp32",
        **common,
        "HAS_GRAD_LOGPS": "constexpr",
        "HAS_GRAD_ENTROPY": "constexpr",
    }
    try:
        fwd = _compile_for_sm90(
            impl._logsoftmax_gather_fwd_kernel, fwd_sig, {"BLOCK_V": 8192, "RETURN_ENTROPY": True}, num_warps=16
        )
    except (ImportError, FileNotFoundError) as exc:  # a Triton build without the NVIDIA toolchain
        pytest.skip(f"no CUDA toolchain in this Triton build: {exc}")
    bwd = _compile_for_sm90(
        impl._logsoftmax_gather_bwd_kernel,
        bwd_sig,
        {"BLOCK_V": 8192, "HAS_GRAD_LOGPS": True, "HAS_GRAD_ENTROPY": True},
        num_warps=16,
    )
    assert "cubin" in fwd.asm and "cubin" in bwd.asm


def test_launches_are_guarded_by_the_tensors_device(monkeypatch):
    """Every Triton launch runs under the device guard of the tensor it reads (a model spread over GPUs)."""
    import importlib

    from shared_prefix_logps.kernels import _triton_utils

    # The package re-exports the function under the module's name, so the module is taken from sys.modules.
    module = importlib.import_module("shared_prefix_logps.kernels.triton_logsoftmax_gather")

    guarded = []
    real_guard = _triton_utils.device_guard

    def recording_guard(tensor):
        guarded.append(tensor.device)
        return real_guard(tensor)

    monkeypatch.setattr(module, "device_guard", recording_guard)
    monkeypatch.setattr(module, "interpret_enabled", lambda: True)
    if not TRITON_OK:
        pytest.skip("triton is not importable")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.randn(3, 70, requires_grad=True)
    targets = torch.tensor([1, 5, 69])
    logsoftmax_gather(logits, targets, implementation="triton").sum().backward()
    assert guarded == [logits.device, logits.device]


def test_device_guard_selects_the_tensors_gpu():
    from shared_prefix_logps.kernels._triton_utils import device_guard

    class OnSecondGpu:  # stands in for a CUDA tensor: the guard reads only these two attributes
        is_cuda = True
        device = torch.device("cuda", 1)

    guard = device_guard(OnSecondGpu())
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(device_guard(torch.zeros(1)), torch.cuda.device)

"""The probe that decides whether compiled Triton kernels can launch on CUDA, and the fallback to torch.

No GPU is needed: CUDA tensors are stood in for by objects that say ``is_cuda`` (the resolver reads nothing else),
Triton's compiler lookup runs against a PATH of our making, and a failing trial launch raises what Triton raises
without a compiler. The trial kernel itself runs for real through Triton's CPU interpreter.
"""

from __future__ import annotations

import os
import stat
import warnings
from types import SimpleNamespace

import pytest
import torch
from support.triton_cpu import TRITON_OK

from shared_prefix_logps.kernels import fused_head, implementation, launch_probe, linear_logps, resolve_implementation

FAKE_CUDA = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
#: What triton.runtime.build raises when it finds no C compiler (Triton 3.4 to 3.9).
NO_COMPILER = RuntimeError(
    "Failed to find C compiler. Please specify via CC environment variable or set triton.knobs.build.impl."
)

needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")


@pytest.fixture
def fresh_probe(monkeypatch):
    """A process in which the probe has not run and has not warned; compiled (not interpreted) Triton."""
    monkeypatch.setattr(launch_probe, "_status", None)
    monkeypatch.setattr(launch_probe, "_warned", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return monkeypatch


def _executable(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_compiler_lookup_follows_triton(tmp_path, monkeypatch):
    """$CC as given (none if it names no executable), else gcc, else clang: Triton's own order."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launch_probe.find_c_compiler() is None
    clang = _executable(tmp_path, "clang")
    assert launch_probe.find_c_compiler() == clang
    gcc = _executable(tmp_path, "gcc")
    assert launch_probe.find_c_compiler() == gcc
    monkeypatch.setenv("CC", "cc-that-does-not-exist")
    assert launch_probe.find_c_compiler() is None  # Triton would run $CC and fail, gcc present or not
    monkeypatch.setenv("CC", "clang")
    assert launch_probe.find_c_compiler() == clang


def _no_compiler(fresh_probe, trial):
    calls = []

    def failing_or_not(device):
        calls.append(device)
        trial(device)

    fresh_probe.setattr(launch_probe, "find_c_compiler", lambda: None)
    fresh_probe.setattr(launch_probe, "trial_launch", failing_or_not)
    return calls


def _raise_no_compiler(device):
    raise NO_COMPILER


@needs_triton
def test_auto_falls_back_to_torch_with_one_warning_without_a_compiler(fresh_probe):
    trials = _no_compiler(fresh_probe, _raise_no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [resolve_implementation("auto", FAKE_CUDA, FAKE_CUDA) for _ in range(3)]
    assert chosen == ["torch"] * 3
    assert len(trials) == 1  # probed once per process
    fallback = [w for w in caught if "torch implementation" in str(w.message)]
    assert len(fallback) == 1, [str(w.message) for w in caught]
    assert "no C compiler" in str(fallback[0].message) and "Failed to find C compiler" in str(fallback[0].message)
    with pytest.raises(RuntimeError, match="C compiler"):
        resolve_implementation("triton", FAKE_CUDA)


#: What Triton's launcher build raises where gcc exists but Python's development headers do not.
NO_PYTHON_HEADERS = RuntimeError("/tmp/tmpx/main.c:5:10: fatal error: Python.h: No such file or directory")


def _raise_no_python_headers(device):
    raise NO_PYTHON_HEADERS


@needs_triton
def test_a_compiler_does_not_spare_the_trial_launch(fresh_probe):
    """gcc on the PATH but no Python headers: the launcher build still fails, so finding a compiler proves nothing
    and only a trial launch decides."""
    trials = []

    def failing(device):
        trials.append(device)
        _raise_no_python_headers(device)

    fresh_probe.setattr(launch_probe, "find_c_compiler", lambda: "/usr/bin/gcc")
    fresh_probe.setattr(launch_probe, "trial_launch", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_implementation("auto", FAKE_CUDA) == "torch"
    assert trials == [torch.device("cuda", 0)]
    (fallback,) = [str(w.message) for w in caught if "torch implementation" in str(w.message)]
    assert "C compiler /usr/bin/gcc" in fallback and "Python.h" in fallback
    with pytest.raises(RuntimeError, match="Python.h"):
        resolve_implementation("triton", FAKE_CUDA)


@needs_triton
def test_a_compiler_and_a_working_trial_launch_mean_triton(fresh_probe):
    trials = []
    fresh_probe.setattr(launch_probe, "find_c_compiler", lambda: "/usr/bin/gcc")
    fresh_probe.setattr(launch_probe, "trial_launch", trials.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_implementation("auto", FAKE_CUDA) == "triton"
        assert resolve_implementation("triton", FAKE_CUDA) == "triton"
    assert trials == [torch.device("cuda", 0)]  # once per process
    assert "C compiler /usr/bin/gcc" in launch_probe.cuda_launch_status(torch.device("cuda", 0)).reason


@needs_triton
@pytest.mark.parametrize("compiler", ["/usr/bin/gcc", None])
def test_auto_attention_is_expand_where_triton_kernels_cannot_launch(fresh_probe, compiler):
    """inductor's flex_attention kernels are Triton kernels launched like the fused head's: where the trial launch
    fails, ``auto`` must not pick flex (every layer would fail at its first launch), and ``flex`` is refused by name."""
    from shared_prefix_logps.backends.choice import resolve_attention_backend

    cuda = torch.device("cuda")
    fresh_probe.setattr(launch_probe, "find_c_compiler", lambda: compiler)
    fresh_probe.setattr(launch_probe, "trial_launch", _raise_no_python_headers)
    assert resolve_attention_backend("auto", cuda) == "expand"
    with pytest.raises(ValueError, match=r"backend='flex'.*cannot launch.*Python.h"):
        resolve_attention_backend("flex", cuda)
    assert resolve_attention_backend("expand", cuda) == "expand"
    fresh_probe.setattr(launch_probe, "_status", None)
    fresh_probe.setattr(launch_probe, "trial_launch", lambda device: None)
    assert resolve_attention_backend("auto", cuda) == "flex"
    assert resolve_attention_backend("flex", cuda) == "flex"


@needs_triton
def test_no_compiler_but_a_working_trial_launch_means_triton(fresh_probe):
    trials = _no_compiler(fresh_probe, lambda device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_implementation("auto", FAKE_CUDA) == "triton"
        assert resolve_implementation("auto", FAKE_CUDA) == "triton"
    assert trials == [torch.device("cuda", 0)]


@needs_triton
def test_the_fused_head_computes_with_torch_when_the_probe_fails(fresh_probe):
    """linear_logps through the dispatch a CUDA tensor takes (the probe), forward and backward: the torch numbers,
    one warning for both calls."""
    _no_compiler(fresh_probe, _raise_no_compiler)
    fresh_probe.setattr(implementation, "triton_can_run", lambda *tensors: True)  # as for CUDA tensors
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(13, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 13, (6,), generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = linear_logps(hidden, weight, targets, chunk_size=4)
        got.sum().backward()
        got_grads = hidden.grad.clone(), weight.grad.clone()
        again = linear_logps(hidden, weight, targets, chunk_size=4)
    assert len([w for w in caught if "torch implementation" in str(w.message)]) == 1
    hidden.grad = weight.grad = None
    want = linear_logps(hidden, weight, targets, chunk_size=4, implementation="torch")
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grads, (hidden.grad, weight.grad), rtol=0, atol=0)


RANDOM_DRAWS = (
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "normal",
    "bernoulli",
)
TENSOR_RANDOM_DRAWS = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_")


@pytest.fixture
def record_random_draws(monkeypatch):
    """Every torch function that draws random numbers, on any device (the CUDA generator included), recorded."""
    draws = []

    def recorder(name, original):
        def wrapped(*args, **kwargs):
            draws.append(name)
            return original(*args, **kwargs)

        return wrapped

    for name in RANDOM_DRAWS:
        monkeypatch.setattr(torch, name, recorder(name, getattr(torch, name)))
    for name in TENSOR_RANDOM_DRAWS:
        monkeypatch.setattr(torch.Tensor, name, recorder(name, getattr(torch.Tensor, name)))
    cpu_state = torch.get_rng_state()
    yield draws
    assert torch.equal(torch.get_rng_state(), cpu_state)


@needs_triton
def test_trial_kernel_launches_and_draws_no_random_numbers(record_random_draws, monkeypatch):
    """The trial kernel's source is valid Triton (run through the interpreter on CPU) and its launch draws nothing."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch_probe.trial_launch(torch.device("cpu"))
    assert record_random_draws == []


def test_fp32_accumulate_probe_draws_no_random_numbers(record_random_draws, monkeypatch):
    """The addmm(out_dtype=float32) probe runs on the first half-precision backward: drawing from the (CUDA) RNG
    there would shift every later random number of a seeded training run."""
    monkeypatch.setattr(fused_head, "_FP32_OUT_ADDMM_OK", {})
    assert fused_head._fp32_out_addmm_ok(torch.device("cpu"), torch.bfloat16) is False  # no CPU kernel in torch
    assert record_random_draws == []


def test_probe_module_imports_without_triton(tmp_path):
    """Without Triton the probe module still imports and reports Triton unusable (no NameError on ``tl``)."""
    import subprocess
    import sys

    shim = tmp_path / "triton"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('Triton made unimportable for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = (
        "import torch\n"
        "from shared_prefix_logps.kernels import launch_probe, resolve_implementation\n"
        "print(launch_probe.cuda_launch_status(torch.device('cuda')).reason)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Triton is not importable"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trial_launch_on_cuda(fresh_probe):
    """On the GPU machine: the trial kernel compiles and launches, and the probe's verdict matches it."""
    launch_probe.trial_launch(torch.device("cuda"))
    status = launch_probe.cuda_launch_status(torch.device("cuda"))
    assert status.ok, status.reason

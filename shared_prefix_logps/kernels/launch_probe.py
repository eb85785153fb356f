"""Whether compiled Triton kernels can launch on CUDA in this process, found out once, before Triton is chosen.

At its first compiled launch in a process Triton builds a small C extension (its CUDA driver utilities and kernel
launcher) with the system's C compiler and Python's headers, unless a build of the same source is already in its
cache (``~/.triton/cache``). Slim runtime images lack the compiler or the headers, and the launch then raises long
after Triton was chosen: every fused-head call fails, and so does every layer of the ``flex`` backend (inductor's
flex_attention kernels are Triton kernels launched the same way). So on CUDA Triton counts as usable only if a trial
launch of a one-element kernel succeeds. A C compiler found the way Triton looks for one (``triton.knobs.build.impl``,
else ``$CC``, else ``gcc``, else ``clang``; ``triton/runtime/build.py``) is not enough (without Python's headers the
build still fails), and none found is not the end (the cache may hold a build made elsewhere); the compiler found
is named in the verdict.

Who asks: ``implementation="auto"`` of the kernels (:mod:`.implementation`) and ``backend="auto"`` of the entry points
(flex on CUDA only where the probe passes; ``backends.flex.compiled_kernels_launch``).

The probe runs once per process, writes one int32, and draws no random numbers (the caller's RNG streams stay as
they were, so seeded runs do not depend on whether it ran).
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass

import torch

from ._triton_utils import LazyKernel, device_guard, triton_importable

try:
    import triton.language as tl
except Exception:  # no Triton: the trial kernel is never launched (triton_importable() is False)
    tl = None


@dataclass(frozen=True)
class LaunchStatus:
    """Outcome of the probe: ``ok`` when compiled Triton kernels launch here; ``reason`` says how it was decided."""

    ok: bool
    reason: str


_status: LaunchStatus | None = None
_warned = False


def find_c_compiler() -> str | None:
    """The C compiler Triton would build its launcher with, or None when Triton would find none.

    Mirrors ``triton.runtime.build``: a custom build function (``triton.knobs.build.impl``) needs no compiler;
    ``$CC`` is used as given (so a ``$CC`` that names no executable means the build fails); otherwise gcc, then clang.
    """
    if triton_importable():
        import triton

        build = getattr(getattr(triton, "knobs", None), "build", None)  # triton.knobs arrived in Triton 3.4
        if getattr(build, "impl", None) is not None:
            return "triton.knobs.build.impl"
    cc = os.environ.get("CC")
    if cc is not None:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def _store_one_kernel(out_ptr):
    tl.store(out_ptr, 1)


_store_one = LazyKernel(_store_one_kernel)


def trial_launch(device: torch.device) -> None:
    """Launch a one-element Triton kernel on ``device`` and check what it wrote; raises whatever the launch raises."""
    out = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(out):
        _store_one[(1,)](out)
    if int(out.item()) != 1:  # .item() also waits for the kernel
        raise RuntimeError("the trial Triton kernel ran but did not write its output")


def cuda_launch_status(device: torch.device) -> LaunchStatus:
    """Whether compiled Triton kernels launch in this process (probed on ``device`` the first time, then cached)."""
    global _status
    if _status is None:
        _status = _probe(device)
    return _status


def _probe(device: torch.device) -> LaunchStatus:
    if not triton_importable():
        return LaunchStatus(False, "Triton is not importable")
    compiler = find_c_compiler()
    found = (
        f"C compiler {compiler}"
        if compiler is not None
        else "no C compiler found (Triton builds its CUDA launcher with $CC, gcc or clang)"
    )
    try:
        trial_launch(device)
    except Exception as exc:  # Triton raises RuntimeError, CalledProcessError, ImportError ... depending on version
        first_line = (str(exc).splitlines() or [""])[0][:200]
        return LaunchStatus(False, f"{found}, and a trial launch failed: {type(exc).__name__}: {first_line}")
    if compiler is None:
        return LaunchStatus(True, f"{found}, but a trial launch succeeded (Triton's cache holds its launcher)")
    return LaunchStatus(True, f"a trial launch succeeded ({found})")


def warn_fallback_once(status: LaunchStatus) -> None:
    """One warning per process that ``implementation="auto"`` computes with torch on CUDA, and why."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"Triton kernels cannot launch on CUDA here ({status.reason}); the log-softmax-gather statistics use the "
        "torch implementation instead (same results, slower). Install gcc or clang (or set CC to a C compiler) and "
        "Python's development headers to use the Triton kernels.",
        RuntimeWarning,
        stacklevel=4,
    )

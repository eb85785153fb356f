"""Which varlen attention kernels the ``flash`` backend calls, behind one interface.

:class:`VarlenKernels` is the interface: ``forward`` returns the output and the (heads, total_q) float32 log-sum-exp,
``backward`` takes the output and log-sum-exp and returns (dq, dk, dv), with flash-attn's conventions (bottom-right
causal alignment, left windows, softcap, empty rows; a pure-torch reference of them, which the CPU tests substitute
(:func:`substituted`), is ``tests/support/flash_reference.py``). Two implementations:

- flash-attn 2.x (package ``flash_attn``, ``flash_attn.flash_attn_interface``);
- FA3 (package ``flash_attn_interface``, the Hopper build), preferred where installed.

flash-attn's private ``_flash_attn_varlen_forward/_backward`` are called by keyword, so their positional orders (which
changed across 2.x releases and differ in FA3) do not matter; parameters this backend does not use get their
defaults, or None. Since 2.7 the backward writes into caller-allocated dq/dk/dv and returns only ``softmax_d``, so
the buffers are always allocated here. Head dimensions are zero-padded to a multiple of 8 and query/key and value
head dimensions to a common size (the kernels take neither odd sizes nor MLA's differing ones): zero features add
nothing to a score (the scale is passed explicitly) and zero value features give output columns that are dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Largest (padded) head dimension flash-attn 2.x and FA3 take.
MAX_HEAD_DIM = 256

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenKernels:
    """A varlen attention implementation.

    Attributes:
        name: shown in error messages ("flash-attn 2", "FA3", "reference").
        forward: ``forward(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, window_left, softcap)`` ->
            (out (total_q, heads, v_head_dim) in q's dtype, lse (heads, total_q) float32).
        backward: ``backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, window_left,
            softcap)`` -> (dq, dk, dv).
        max_head_dim: the largest head dimension taken (None: any).
        dtypes: the dtypes taken (None: any).
    """

    name: str
    forward: object
    backward: object
    max_head_dim: int | None = MAX_HEAD_DIM
    dtypes: tuple | None = _HALF_DTYPES

    def dtype_refusal(self, query: torch.Tensor) -> str | None:
        """Why these kernels cannot compute in ``query``'s dtype, or None."""
        if self.dtypes is not None and query.dtype not in self.dtypes:
            return f"{self.name} computes in float16/bfloat16, not {query.dtype}"
        return None

    def head_dim_refusal(self, query: torch.Tensor, value: torch.Tensor) -> str | None:
        """Why these kernels cannot take the head dimensions of (…, head_dim) ``query`` and ``value``, or None."""
        dim = max(query.shape[-1], value.shape[-1])
        if self.max_head_dim is not None and _round8(dim) > self.max_head_dim:
            return f"{self.name} takes head dimensions up to {self.max_head_dim}, not {dim}"
        return None


#: Kernels that replace flash-attn on every device while set (:func:`substituted`).
_SUBSTITUTE: list[VarlenKernels] = []


@contextlib.contextmanager
def substituted(kernels: VarlenKernels):
    """Run the ``flash`` layout on ``kernels`` on any device, installed flash-attn or not: how the CPU tests run it (on
    the pure-torch reference of the varlen kernels, ``tests/support/flash_reference.py``)."""
    _SUBSTITUTE.append(kernels)
    try:
        yield kernels
    finally:
        _SUBSTITUTE.pop()


def kernels_for(device: torch.device) -> VarlenKernels | None:
    """The kernels the ``flash`` backend runs on ``device``: a substitute when one is set, else FA3 or flash-attn 2
    on CUDA where installed; None when there are none."""
    if _SUBSTITUTE:
        return _SUBSTITUTE[-1]
    if torch.device(device).type != "cuda":
        return None
    return _installed()


def unavailable_reason(device: torch.device) -> str:
    """Why ``backend='flash'`` cannot run on ``device`` (for the error message)."""
    if torch.device(device).type != "cuda":
        return (
            f"backend='flash' runs flash-attn's CUDA kernels; the model is on {torch.device(device).type}. "
            "Use backend='expand' (any device) or 'flex'"
        )
    return (
        "backend='flash' needs flash-attn >= 2.7 (pip install 'shared-prefix-logps[flash]') or FA3's "
        "flash_attn_interface; neither is importable here. Use backend='flex' or 'expand'"
    )


_INSTALLED: list = []


def _installed() -> VarlenKernels | None:
    """FA3 or flash-attn 2's kernels, imported once."""
    if not _INSTALLED:
        _INSTALLED.append(_import_kernels())
    return _INSTALLED[0]


def _import_kernels() -> VarlenKernels | None:
    for module_name, name in (("flash_attn_interface", "FA3"), ("flash_attn.flash_attn_interface", "flash-attn 2")):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        forward = getattr(module, "_flash_attn_varlen_forward", None) or getattr(module, "_flash_attn_forward", None)
        backward = getattr(module, "_flash_attn_varlen_backward", None) or getattr(module, "_flash_attn_backward", None)
        if forward is not None and backward is not None:
            return _package_kernels(name, forward, backward)
    return None


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _bind(fn, values: dict) -> dict:
    """Keyword arguments for ``fn``: ``values`` where ``fn`` names them, window sizes in the form ``fn`` takes
    (a ``window_size`` pair or ``window_size_left``/``_right``), and None for any other parameter without a default
    (FA3's optional inputs: paged KV, rotary, descales, ...)."""
    # flash-attn >= 2.7 defines them as torch.library custom ops, whose own signature is (*args, **kwargs); the
    # function they were made from keeps the parameter names (the op's schema takes the same names as keywords).
    parameters = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in parameters.values()):
        raise TypeError(f"cannot bind the arguments of {fn!r}: its signature names no parameters")
    kwargs = {}
    for name, parameter in parameters.items():
        if name in values:
            kwargs[name] = values[name]
        elif name == "window_size":
            kwargs[name] = (values["window_size_left"], values["window_size_right"])
        elif parameter.default is inspect.Parameter.empty:
            kwargs[name] = None
    return kwargs


def _package_kernels(name: str, forward_fn, backward_fn) -> VarlenKernels:
    """A :class:`VarlenKernels` over a flash-attn package's private varlen forward/backward."""

    def common(cu_q, cu_k, max_q, max_k, scale, causal, window_left, softcap):
        return dict(
            cu_seqlens_q=cu_q.to(torch.int32),
            cu_seqlens_k=cu_k.to(torch.int32),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            is_causal=causal,
            window_size_left=window_left,
            window_size_right=0 if causal else -1,
            softcap=float(softcap or 0.0),
            return_softmax=False,
            deterministic=False,
        )

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, window_left=-1, softcap=0.0):
        v_dim = v.shape[-1]
        q, k, v = _padded(q, k, v)
        values = dict(q=q, k=k, v=v, **common(cu_q, cu_k, max_q, max_k, scale, causal, window_left, softcap))
        out, lse, *_ = forward_fn(**_bind(forward_fn, values))
        return out[..., :v_dim], lse

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal, window_left=-1, softcap=0.0):
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        q, k, v = _padded(q, k, v)
        dout, out = (F.pad(t, (0, q.shape[-1] - v_dim)) for t in (dout, out))
        # Zeros, not empty: rows of a sequence without keys (a prompt without prefix) or keys of one without queries
        # (a prompt whose completions are all empty) may be left unwritten by a kernel that skips them.
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        values = dict(
            dout=dout.contiguous(),
            q=q,
            k=k,
            v=v,
            out=out.contiguous(),
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            **common(cu_q, cu_k, max_q, max_k, scale, causal, window_left, softcap),
        )
        backward_fn(**_bind(backward_fn, values))
        return dq[..., :qk_dim], dk[..., :qk_dim], dv[..., :v_dim]

    return VarlenKernels(name, forward, backward)


def _padded(q, k, v):
    """q, k, v zero-padded to one head dimension, a multiple of 8, and contiguous."""
    dim = _round8(max(q.shape[-1], v.shape[-1]))
    return tuple(F.pad(t, (0, dim - t.shape[-1])).contiguous() for t in (q, k, v))

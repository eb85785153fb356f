"""The ``flex`` layout of a node call: no copies, one ``flex_attention`` call per layer.

No padding token is processed and no ancestor is copied per node. The call's packed tokens attend over ``[every token
of the ancestor store ; the call's own tokens]`` under a BlockMask built from the trie's structure in work
proportional to the blocks visited (:mod:`.flex_blocks`), never by evaluating the mask at every (query, key) pair:
one key segment per node run of the store and of the call, a link from each of the call's nodes to each of its
ancestors in the store and a causal link to itself. With nodes numbered depth-first, key node k is an ancestor of (or
is) query node q exactly when ``k <= q < subtree_end[k]``; the mask function, which runs inside the kernel on the
partial blocks only, tests that, causality within a node and sliding windows by positions.

Lengths are rounded up to a multiple of :data:`LENGTH_BUCKET` inside the attention call (the padded queries see
nothing and are dropped). On CUDA flex_attention is compiled once per model configuration and grad mode, with
dynamic lengths: new shapes, every depth and sliding windows (None or int) reuse the graph. Should torch's recompile
limit be hit anyway, :class:`FlexRecompileError` is raised instead of torch's silent fallback to uncompiled
flex_attention (which materializes every score). Head dimensions below the kernel's minimum (16 on CUDA) are
zero-padded, which changes no result. flex_attention's backward exists on CUDA only; on CPU this backend is
forward-only and runs uncompiled.

Head dimensions 192 and 256 on CUDA (torch/_inductor/template_heuristics/triton.py, torch 2.11 and 2.13): without
max-autotune one configuration per (GPU, dtype, head_dim). 256: H100 bf16/fp16 BLOCK_M x BLOCK_N 64 x 32, 3 stages,
4 warps (fp32 32 x 32); A100 32 x 64. 192: padded to 256 inside the kernel (QK_HEAD_DIM_ROUNDED); no H100 entry for
bf16 (nor, in 2.11, for fp32), so torch would take the default 64 x 64, 3 stages, 4 warps, whose shared memory at
256-wide tiles an H100 block does not have: the backend passes the 256 entry instead (:mod:`.flex_kernel_options`,
which also tells the kernel that every length is a multiple of 128: IS_DIVISIBLE). Backward on sm90 above 128:
64 x 64 blocks, 2 stages. Every block size divides the 128-token blocks of the masks built here, which the lowering
requires (tests/backends/test_flex_head_dim.py).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.nn.functional as F

from .expand import cached, masked_attention
from .flex_blocks import BLOCK_SIZE, Links, Segments, concat_segments, run_segments, structured_block_mask
from .flex_kernel_options import kernel_options
from .layouts import LayerCall
from .non_finite import NonFiniteGuard

#: Packed lengths are padded up to a multiple of this inside the attention call: the block size of the masks.
LENGTH_BUCKET = BLOCK_SIZE

#: The window given to layers without a sliding window: larger than any position difference, so windowed and
#: unwindowed layers (Gemma2 alternates them) share one mask function instead of compiling one graph each.
NO_WINDOW = 2**62

#: torch.compile backend of flex_attention per device type; None runs it uncompiled. CPU runs
#: it eagerly (inductor's CPU flex kernel needs a C++ toolchain and gains little at CPU sizes); tests select
#: "aot_eager" (or a backend that counts its graphs) here to run the compiled path on CPU.
_COMPILE_BACKENDS: dict[str, object] = {"cuda": "inductor", "cpu": None}

#: The smallest head dimension flex_attention's kernel takes per device type: inductor's CUDA lowering refuses
#: query/key or value head dimensions below 16 (``tl.dot`` needs K >= 16; "NYI: embedding dimension of the query, key,
#: and value must be at least 16" in torch/_inductor/kernel/flex/flex_attention.py). Smaller heads are zero-padded.
MIN_HEAD_DIM: dict[str, int] = {"cuda": 16}

#: flex_attention's backward per device type. torch refuses it on CPU up front, although its dense reference
#: implementation runs there; tests that lift torch's check set "cpu" here to run training through flex on CPU.
_BACKWARD_DEVICES = {"cuda"}


class FlexRecompileError(RuntimeError):
    """torch.compile hit its recompile limit on the flex path.

    torch would otherwise run flex_attention uncompiled from then on, which materializes the full (queries x keys)
    score matrix of every layer: hundreds of GB at long prompts and large G, an out-of-memory error far from the
    cause, or silently slow steps.
    """


def flex_available(device: torch.device) -> bool:
    """Whether torch ships flex_attention for this device at all."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return device.type in ("cuda", "cpu")


def compiled_kernels_launch(device: torch.device) -> bool:
    """Whether flex_attention's compiled kernels can launch on ``device``: where it is compiled with inductor
    (CUDA), inductor's kernels are Triton kernels, whose launcher Triton builds with a C compiler and Python's headers
    at the first launch, so the launch probe's trial launch decides (``kernels.launch_probe``; once per process).
    True where flex runs uncompiled."""
    if _COMPILE_BACKENDS.get(device.type) != "inductor":
        return True
    from ..kernels import launch_probe

    return launch_probe.cuda_launch_status(device).ok


def backward_available(device: torch.device) -> bool:
    """Whether the flex backend can run with gradients on ``device`` (flex_attention's backward exists there)."""
    return device.type in _BACKWARD_DEVICES


def _flex_entry(query, key, value, block_mask, score_mod, scale, enable_gqa, kernel_options, aux):
    """What is compiled for the attention: flex_attention, with ``kernel_options`` those of
    :mod:`.flex_kernel_options` (None off CUDA) and ``aux`` the kwargs that request the log-sum-exp (empty when not
    requested)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        kernel_options=kernel_options,
        **aux,
    )


@functools.cache
def _compiled(entry, backend, configuration):
    """``entry`` compiled with ``backend``, for one static ``configuration`` (a hashable tuple).

    Dynamo keeps its compilations, and counts them against ``torch._dynamo.config.recompile_limit``, per code object.
    Each configuration (device, dtype, head counts and sizes, scale, softcap, grad mode: what a model fixes) gets a
    code object of its own, so that a policy in bfloat16 and a float32 reference, or scoring and training, do not
    share one budget; within a configuration only the lengths vary, and they are dynamic from the first call
    (``dynamic=True``). ``fullgraph=True`` turns the recompile limit into an exception instead of an uncompiled
    fallback (see :func:`_run_compiled`).
    """
    code = entry.__code__.replace(co_name=f"{entry.__name__}_{len(_CONFIGURATIONS)}")
    _CONFIGURATIONS.append((entry.__name__, configuration))
    fn = types.FunctionType(code, entry.__globals__, code.co_name, entry.__defaults__, entry.__closure__)
    return torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)


# (entry name, configuration) of every compiled code object, in the order they were made.
_CONFIGURATIONS: list = []


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """The exception types dynamo raises at its recompile limit under fullgraph=True (renamed across versions)."""
    from torch._dynamo import exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


@contextlib.contextmanager
def _tracing_settings():
    """Settings under which the flex path's functions are traced (they take effect when a call compiles).

    - Floats (the attention scale, a softcap) are constants of a model and part of the configuration: specialized,
      they stay out of the graph's inputs (dynamo otherwise traces them as symbolic values, which flex's backward
      does not take).
    - No duck sizing: a call without ancestors has as many keys as queries, the others more; with duck sizing the first
      call would give both lengths one symbol and the other kind of call would compile again.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        from torch.fx.experimental import _config as fx_config

        if hasattr(fx_config, "use_duck_shape"):
            stack.enter_context(fx_config.patch(use_duck_shape=False))
        yield


def _run_compiled(what: str, fn, *args):
    """``fn(*args)``, with dynamo's recompile-limit failure turned into a :class:`FlexRecompileError` that says why."""
    try:
        with _tracing_settings():
            return fn(*args)
    except _recompile_limit_errors() as error:
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        raise FlexRecompileError(
            f"the flex backend's compiled {what} hit torch._dynamo.config.recompile_limit ({limit}): the shapes or "
            "guards of its inputs changed more often than the shared-prefix path expects, and torch would fall back "
            "to uncompiled flex_attention, which materializes every layer's full score matrix. Run with "
            "TORCH_LOGS=recompiles to see what changed; raise torch._dynamo.config.recompile_limit, or use "
            "backend='expand'."
        ) from error


def _flex_call(query, key, value, *, block_mask, scale, score_mod, return_lse=False):
    """flex_attention over (1, heads, q_len, head_dim) queries; with ``return_lse`` also the (1, heads, q_len)
    float32 log-sum-exp of each query's scores (natural log)."""
    from torch.nn.attention import flex_attention as flex_module

    enable_gqa = query.shape[1] != key.shape[1]
    if not return_lse:
        aux = {}
    elif hasattr(flex_module, "AuxRequest"):
        aux = {"return_aux": flex_module.AuxRequest(lse=True)}
    else:
        aux = {"return_lse": True}  # torch before AuxRequest
    backend = _COMPILE_BACKENDS.get(query.device.type)
    options = kernel_options(query.device, query.dtype, query.shape[3])  # a function of the configuration below
    if backend is None:
        out = _flex_entry(query, key, value, block_mask, score_mod, scale, enable_gqa, options, aux)
    else:
        query, key, value = _same_grad_requirement(query, key, value)
        configuration = (
            str(query.device),
            query.dtype,
            tuple(query.shape[i] for i in (1, 3)),
            tuple(key.shape[i] for i in (1, 3)),
            value.shape[3],
            scale,
            getattr(score_mod, "softcap", None),
            return_lse,
            torch.is_grad_enabled(),
        )
        fn = _compiled(_flex_entry, backend, configuration)
        out = _run_compiled(
            "flex_attention", fn, query, key, value, block_mask, score_mod, scale, enable_gqa, options, aux
        )
    if "return_aux" in aux:
        return out[0], out[1].lse
    return out


def _same_grad_requirement(*tensors):
    """The tensors, all requiring grad when any does (a leaf alias of those that do not).

    Which of query/key/value requires grad is part of a compiled graph's guards; it varies with what is trained
    (LoRA on some projections only: the first layer's keys come from frozen embeddings), so it is made uniform.
    The extra gradients are computed in the same backward kernel and dropped.
    """
    if (
        not torch.is_grad_enabled()
        or all(t.requires_grad for t in tensors)
        or not any(t.requires_grad for t in tensors)
    ):
        return tensors
    return tuple(t if t.requires_grad else t.detach().requires_grad_() for t in tensors)


def _round_up(n: int, device: torch.device) -> int:
    """``n`` rounded up to whole blocks; compiled, at least two: dynamo specializes dimensions of size 1, so a
    one-block mask would compile a graph of its own (the padded block is fully masked and skipped)."""
    blocks = 2 if _COMPILE_BACKENDS.get(device.type) is not None else 1
    return max(blocks * LENGTH_BUCKET, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET)


def padded_length(n: int, device: torch.device) -> int:
    """The length a packed run of ``n`` queries or keys is padded to inside the attention call on ``device``: whole
    mask blocks (see :func:`_round_up`)."""
    return _round_up(n, device)


def _pad_seq(x: torch.Tensor, length: int) -> torch.Tensor:
    # (1, heads, n, d) -> (1, heads, length, d)
    return F.pad(x, (0, 0, 0, length - x.shape[2]))


def _score_mod(softcap):
    if softcap is None:
        return None

    def soft_cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    soft_cap.softcap = softcap  # part of the compiled configuration (a constant in the graph)
    return soft_cap


#: The optional node-call fields this layout reads (``layouts.py``): none, the trie's structure of every call suffices.
CALL_FIELDS = ()


def unavailable(device: torch.device, needs_grad: bool) -> str | None:
    """Why ``backend='flex'`` cannot run on ``device`` (None: it can): torch's flex_attention must exist there and its
    compiled kernels launch. With gradients where flex_attention has no backward (CPU), the layout runs its mask
    materialized through SDPA (:func:`_attend_materialized`)."""
    if not flex_available(device):
        return f"backend='flex' needs torch's flex_attention on {device.type}"
    if not compiled_kernels_launch(device):
        from ..kernels.launch_probe import cuda_launch_status

        return (
            "backend='flex' compiles flex_attention into Triton kernels, which cannot launch here "
            f"({cuda_launch_status(device).reason}); use backend='expand'"
        )
    return None


def node_attention(query, key, value, layer: LayerCall) -> torch.Tensor:
    """(1, T, heads, v_head_dim) for a node call's packed (1, heads, T, head_dim) queries and (1, kv_heads, T,
    head_dim) keys, attending over ``[every token of the ancestor store ; the call's own tokens]`` in one
    flex_attention call under a BlockMask built from the trie's structure (:func:`node_block_mask`).

    ``layer``: the layer's :class:`~.layouts.LayerCall` (its ``ancestors`` concatenated are the store; with
    ``needs_grad`` the mask also holds the indices flex's backward reads). Dropout is refused; head dimensions below
    the kernel's minimum are zero-padded; sinks are applied from the log-sum-exp.
    """
    call, ancestors, window, needs_grad = layer.call, layer.ancestors, layer.window, layer.needs_grad
    n = query.shape[2]
    if ancestors:
        key = torch.cat([*(k[None] for k, _ in ancestors), key], dim=2)
        value = torch.cat([*(v[None] for _, v in ancestors), value], dim=2)
    if needs_grad and not backward_available(query.device):
        return _attend_materialized(query, key, value, layer)
    q_len = padded_length(n, query.device)
    kv_len = padded_length(key.shape[2], query.device)

    def build():
        q_blocks = bool(needs_grad or torch.is_grad_enabled())  # read before no_grad below
        with torch.no_grad():
            return node_block_mask(call, window, q_len, kv_len, q_blocks=q_blocks)

    mask = cached(layer.cache, ("flex", window), build)
    return _attend(query, key, value, mask, q_len, n, layer.options, kv_len=kv_len, watch=layer.non_finite)


def _attend(query, key, value, block_mask, q_len, n, options, kv_len=None, watch=None):
    if options["dropout"]:
        raise ValueError("the flex backend does not apply attention dropout; use backend='expand'")
    kv_len = q_len if kv_len is None else kv_len
    sinks = options.get("sinks")
    v_head_dim = value.shape[3]
    # One row's NaN or inf stays in its row (the kernel's masked weights would multiply it by zero): non_finite.
    probe = functools.partial(_flex_call, block_mask=block_mask, scale=1.0, score_mod=None)
    width = max(16, MIN_HEAD_DIM.get(query.device.type, 0))
    guard = NonFiniteGuard(probe, q_len, kv_len, width=width, watch=watch)
    query, key, value = guard.inputs(query, key, value)
    query, key, value = _widen_heads(query, key, value)
    out = _flex_call(
        _pad_seq(query, q_len),
        _pad_seq(key, kv_len),
        _pad_seq(value, kv_len),
        block_mask=block_mask,
        scale=options["scaling"],
        score_mod=_score_mod(options["softcap"]),
        return_lse=sinks is not None,
    )
    if sinks is not None:
        out = _apply_sinks(*out, sinks)
    return guard.output(out[:, :, :n, :v_head_dim]).transpose(1, 2).contiguous()


def _attend_materialized(query, key, value, layer: LayerCall) -> torch.Tensor:
    """The layout's attention where torch's flex_attention has no backward (CPU) and gradients are wanted: the same
    visibility (:func:`dense_node_mask`) materialized as one boolean (T, A + T) mask per call and window, one SDPA call
    per layer (explicit scores for softcap and sinks), one row's non-finite values kept in their row as the kernel
    path keeps them. Memory: the mask, (T x (A + T)) bytes per call: for tests and CPU runs, not for long rows."""
    options = layer.options
    if options["dropout"]:
        raise ValueError("the flex backend does not apply attention dropout; use backend='expand'")
    visible = cached(layer.cache, ("flex-dense", layer.window), lambda: dense_node_mask(layer.call, layer.window))
    mask = visible[None, None]

    def probe(q, k, v):  # (1, 1, length, width) float32 -> (1, 1, n, width), as NonFiniteGuard expects
        return masked_attention(q, k, v, mask, scaling=1.0, softcap=None, dropout=0.0).transpose(1, 2)

    guard = NonFiniteGuard(probe, query.shape[2], key.shape[2], width=16, watch=layer.non_finite)
    query, key, value = guard.inputs(query, key, value)
    out = masked_attention(
        query,
        key,
        value,
        mask,
        scaling=options["scaling"],
        softcap=options["softcap"],
        dropout=0.0,
        sinks=options.get("sinks"),
    )
    return guard.output(out.transpose(1, 2)).transpose(1, 2)


def dense_node_mask(call, window) -> torch.Tensor:
    """(T, A + T) bool on the call's device: which of [the ancestor store ; the call's own tokens] each of a node
    call's T tokens sees: its nodes' ancestors and its own node causally (the same test as the flex kernel's mask
    function), within the sliding window by positions. Every token sees itself."""
    q_node, q_order, q_pos = call.query_node, call.query_order, call.positions[0]
    k_node = torch.cat([call.store_node, q_node])
    k_order = torch.cat([call.store_order, q_order])
    k_pos = torch.cat([call.store_positions, q_pos])
    k_end = call.node_end[k_node]
    visible = (k_node[None, :] <= q_node[:, None]) & (q_node[:, None] < k_end[None, :])
    visible &= (k_node[None, :] != q_node[:, None]) | (k_order[None, :] <= q_order[:, None])
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    return visible


def _widen_heads(query, key, value):
    """query/key/value with head dimensions below the device's kernel minimum (:data:`MIN_HEAD_DIM`) zero-padded up
    to it. Zero features add exactly nothing to a query-key product (the scale is passed explicitly), and zero value
    features give output columns that are dropped, so the attention and its gradients are unchanged."""
    minimum = MIN_HEAD_DIM.get(query.device.type, 0)
    qk_pad, v_pad = max(0, minimum - query.shape[3]), max(0, minimum - value.shape[3])
    if qk_pad:
        query, key = F.pad(query, (0, qk_pad)), F.pad(key, (0, qk_pad))
    if v_pad:
        value = F.pad(value, (0, v_pad))
    return query, key, value


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Renormalize flex's output for attention sinks (a score_mod cannot add a denominator term).

    ``out`` (1, heads, q_len, v_head_dim) is softmax-weighted over the real keys, whose scores have log-sum-exp
    ``lse`` (1, heads, q_len); a sink logit ``s`` per head adds ``exp(s)`` to the denominator, which scales every
    weight by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``. Differentiable in ``out``, ``lse`` and ``sinks``.
    """
    factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * factor[..., None]).to(out.dtype)


def node_block_mask(call, window, q_len: int, kv_len: int, *, q_blocks: bool = True):
    """BlockMask of a node call's queries (padded to ``q_len``) over [store ; own tokens] (padded to ``kv_len``),
    built from the trie's structure in work proportional to its blocks; ``q_blocks``: also the indices backward
    reads. The call's nodes may be of several depths: a node sees its ancestors in the store and, in the call, its
    ancestors before it and itself causally.

    The structure is read from the call's host copy (``call.host``) where there is one, so the host waits for nothing;
    the index tensors and the mask function's tensors are on the call's device. Padded queries (node -2) see no key;
    padded keys (node -1, subtree end -1) are seen by no query.
    """
    host = call.host if getattr(call, "host", None) is not None else call
    node_end = host.node_end
    store_len = host.store_node.numel()
    own, own_nodes = run_segments(host.query_node, host.positions[0])
    store, store_nodes = run_segments(host.store_node, host.store_positions)
    own_keys = Segments(start=own.start + store_len, length=own.length, position=own.position)
    # Node-level pairs: the store's runs that are ancestors of each of the call's nodes, and the call's own nodes that
    # are proper ancestors of others in it (a call of several depths).
    query_seg, key_seg = (
        (store_nodes[None, :] <= own_nodes[:, None]) & (own_nodes[:, None] < node_end[store_nodes][None, :])
    ).nonzero(as_tuple=True)
    inner_query, inner_key = (
        (own_nodes[None, :] < own_nodes[:, None]) & (own_nodes[:, None] < node_end[own_nodes][None, :])
    ).nonzero(as_tuple=True)
    every = torch.arange(own_nodes.numel())
    links = Links(
        query=torch.cat([query_seg, inner_query, every]),
        key=torch.cat([key_seg, inner_key + store_nodes.numel(), every + store_nodes.numel()]),
        causal=torch.cat(
            [
                torch.zeros(query_seg.numel() + inner_query.numel(), dtype=torch.bool),
                torch.ones_like(every, dtype=torch.bool),
            ]
        ),
    )
    node_end = call.node_end
    keys = torch.cat([call.store_node, call.query_node])
    mask_mod = _node_mask_mod(
        _pad(call.query_node, q_len, -2),
        _pad(call.query_order, q_len, 0),
        _pad(call.positions[0], q_len, 0),
        _pad(keys, kv_len, -1),
        _pad(node_end[keys], kv_len, -1),
        _pad(torch.cat([call.store_order, call.query_order]), kv_len, 0),
        _pad(torch.cat([call.store_positions, call.positions[0]]), kv_len, 0),
        window,
    )
    return structured_block_mask(
        own,
        concat_segments(store, own_keys),
        links,
        q_len=q_len,
        kv_len=kv_len,
        window=window,
        mask_mod=mask_mod,
        q_blocks=q_blocks,
        device=call.query_node.device,
    )


def _node_mask_mod(q_node, q_order, q_pos, k_node, k_end, k_order, k_pos, window):
    """The mask function of queries (q_*, each (q_len,) int64) over keys (k_*, (kv_len,) int64): the key's node is
    an ancestor of the query's or is it (then causally by ``order``), within the sliding window by positions.

    The seven tensors are distinct objects (a compiled function guards on aliasing), and ``window`` travels as a
    tensor so that windowed and unwindowed layers share one graph."""
    # Filled on the device, not copied from the host (a pageable copy the host waits for).
    limit = torch.full((), NO_WINDOW if window is None else int(window), device=q_node.device)

    def mask_mod(b, h, q_idx, kv_idx):
        query_node, key_node = q_node[q_idx], k_node[kv_idx]
        ancestor = (key_node <= query_node) & (query_node < k_end[kv_idx])
        causal = (key_node != query_node) | (k_order[kv_idx] <= q_order[q_idx])
        return ancestor & causal & ((q_pos[q_idx] - k_pos[kv_idx]) < limit)

    return mask_mod


def _pad(ids: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """(length,) int64: ``ids`` followed by ``fill``; always a new tensor."""
    return F.pad(ids.long(), (0, length - ids.shape[0]), value=fill).clone()

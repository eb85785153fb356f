"""Peak memory per device of each method, term by term.

Sizes (:class:`~.dims.ModelDims`): H hidden, I intermediate, h query and g KV heads of size d (values dv), V vocab,
n_layers layers, s bytes per element. Workload: B prompts of width P (their real tokens Pt), G generations of width C,
R = B x G rows, n scored (real) completion tokens. The shared methods run a grouped batch's two-level trie: the
prompts' node call (Pt tokens, each prompt a node padded to P in attention), then the completions' (n tokens, each
row a node padded to C, attending over its prompt's P keys).

Saved for backward per token and layer (what a Llama/Qwen layer's autograd graph holds, read from its ops):
    2 RMSNorms      2 x (8H + 4)    float32 x / rsqrt(var) and the normalized output (the same bytes in bf16, where
                                    the float32 upcast is saved instead of the residual's alias)
    2 residuals     2 x H x s       the layer input and the sum after attention, in float32 only (a half-precision
                                    residual is upcast into a copy, which the norms' terms count)
    q, k, v         (h d + g (d + dv)) x s   post-RoPE, saved by SDPA
    attention out   h dv x s + 4h   and its float32 log-sum-exp
    gated MLP       4 I x s         gate, silu(gate), up, their product (mixture of experts: I of the token's
                                    top-k experts and the shared ones, its copies gathered into and out of the
                                    experts, the router's float32 logits and probabilities, averaged over layers)
With gradient checkpointing only the layer input (H x s) stays; one layer's terms come back during backward.

Per method (``dense`` forwards R rows of their real prompt tokens and C completion columns, without a padding
mask, prompts of one real length together; ``trl`` R rows of P + C tokens with their padding mask; ``expand``,
``flex`` and ``chunked`` the node calls above):
    dense     logits (R, C + 1, V) x s, in half precision a float32 (R, C, V) copy of them (the logits freed before
              the log-softmax runs; the copy, or in float32 the logits, referenced until the step returns), float32
              log-probs, their gradients in backward
    trl       TRL's fused head: (min(N, 4096), min(V, 32768)) tiles, N = all R x (P + C - 1) positions where Triton
              is not used (CPU), the scored ones on CUDA; float32 (V, H) weight gradient
    expand    SDPA's padded queries and outputs (:func:`_expand_saved`), additive masks (16-aligned key dims; none
              for the prompts' call unless a window hides keys, one row's for the completions when every prompt
              has P real tokens) and per-row gathered prompt K/V (:func:`expand_terms`, sizes from
              ``backends.expand_memory``). On CPU SDPA saves the gathered K/V of every layer. On CUDA, the fused
              path, KV heads are repeated for a kernel that rejects grouped heads (counted unless
              ``Engine.repeats_kv`` says the kernel takes them; not known, counted, an upper bound of the terms,
              and without gradients the larger peak of the two cuts of the rows the token budget then makes), the
              prompts' SDPA saves its repeated K/V in every layer, and the
              completions' gathered attention is recomputed in backward: no per-row copy or log-sum-exp saved, but a
              layer's attention backward holds its gathered (or repeated) K/V and their gradients at once
    flex      no per-row copies: each layer saves packed [prompts ; completions] keys/values (a copy of the
              prompts', lengths rounded up to 128) instead of the rows' own; the block mask's few bytes
    chunked   the prompts' call saved once (its K/V gradients accumulated beside) plus one generation chunk's call at
              a time (``generations_per_chunk``, G/4 as the bench runs it by default), whose fused head keeps its
              logits for backward where they fit; the head's and the embedding's weight gradients in float32
              buffers through the call (one device, full training)
    no-grad   chunks of rows within the token budget (``engine.budget``; ``Workload.token_budget``), a leaf call
              keeping no K/V
    all shared methods: the prompts' call runs the final norm over the prompts too; the fused head's row chunks
    (``kernels.fused_head``: float32 logits of <= 256 MiB on CPU, <= 8 GiB on CUDA) with the torch statistics'
    float32 temporaries beside them (CPU, or CUDA where Triton cannot launch: ``Engine.head_implementation``), its
    float32 (V, H) weight-gradient accumulator; the plan's and the calls' integer tensors (about 20 int64 per
    token, and expand's index of every (row, prompt token))

Linear-attention hybrids (Qwen3.5, Qwen3-Next; ``dims.LinearAttention``): only the attention layers hold keys/values
(stored, gathered, repeated, their gradients); each Gated DeltaNet layer saves its own per-token terms instead of q,
k, v and the attention output, and the shared methods keep each prompt's end state per Gated DeltaNet layer (float32
recurrence state plus the convolution window: ``prompt recurrent states``), gathered into each completion row's
initial state (``row initial states``), and in ``chunked`` their gradients. A state does not grow with the prompt.

Not modelled: explicit attention scores (softcap or sinks models on expand, ``expand_memory.scores_bytes``), a
second set of masks for models mixing windowed and full-attention layers, and RoPE tables.

On ``cuda`` the parameters, gradients (trainable share) and optimizer states are added, divided by the world size
under FSDP2 / ZeRO-3 (which also hold one layer unsharded at a time); on ``cpu`` (``bench --device cpu``) the
parameters and optimizer are outside the measured step, gradients inside it.

The peak is the largest of a few moments of the step (the forward's largest transient, the start of backward
through the head, expand's attention backward of a layer on CUDA, the end of backward with every gradient
allocated); :class:`MemoryPlan` keeps the terms of the moment that wins, and those of every moment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..backends.expand_memory import AttentionShape, kv_bytes, mask_bytes
from .dims import ModelDims
from .workload import OPTIMIZER_STATE_BYTES, Engine, Workload

METHODS = ("dense", "trl", "expand", "flex", "chunked")

#: Bytes one fused-head chunk may hold on CPU (``kernels.fused_head.DEFAULT_CHUNK_BYTES``).
CPU_HEAD_CHUNK_BYTES = 256 * 2**20
#: On CUDA the fused head sizes its chunk from free memory, within these bounds (``GPU_CHUNK_BYTES_BOUNDS``); the
#: plan takes the upper bound.
CUDA_HEAD_CHUNK_BYTES = 8 * 2**30
#: flex pads packed lengths up to a multiple of its masks' block size (``backends.flex.LENGTH_BUCKET``).
FLEX_BLOCK = 128
#: TRL's fused head tiles: tokens x vocabulary columns.
TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768


@dataclass(frozen=True)
class MemoryPlan:
    """A method's predicted peak bytes per device and the terms it is the sum of (name -> bytes); ``moments`` holds
    the terms of every moment of the step considered (the model state included), the peak's among them."""

    method: str
    peak_bytes: int
    terms: dict[str, int]
    moments: tuple[dict[str, int], ...] = ()

    def largest(self, count: int = 3) -> list[tuple[str, int]]:
        """The ``count`` largest terms, largest first."""
        return sorted(self.terms.items(), key=lambda item: -item[1])[:count]


def layer_bytes_per_token(dims: ModelDims, s: int) -> int:
    """Bytes one token saves for backward in one decoder layer (module docstring), averaged over the layers (a
    hybrid's Gated DeltaNet layers save ``LinearAttention.saved_bytes_per_token`` in place of q, k, v and the
    attention output)."""
    norms = 2 * (8 * dims.hidden + 4)
    # A float32 residual is what the norm's float32 upcast aliases (and saves); a half-precision one is upcast
    # into a copy (counted in the norms) and saved by nothing.
    residuals = 2 * dims.hidden * s if s == 4 else 0
    qkv = (dims.heads * dims.head_dim + dims.kv_heads * (dims.head_dim + dims.v_head_dim)) * s
    attention_out = dims.heads * dims.v_head_dim * s + 4 * dims.heads
    mixer = qkv + attention_out
    if dims.linear is not None:
        linear = dims.linear.saved_bytes_per_token(s)
        mixer = (dims.attention_layers * mixer + dims.linear_layers * linear) / dims.layers
    return round(norms + residuals + mixer + 4 * dims.mlp_width * s + _routing_bytes_per_token(dims, s))


def _routing_bytes_per_token(dims: ModelDims, s: int) -> float:
    """What a mixture-of-experts layer saves per token beyond its experts' gated MLPs, averaged over the layers: the
    router's float32 logits and probabilities, and the token's copies gathered into and out of its top-k experts."""
    if dims.experts is None:
        return 0
    share = dims.moe_layers / dims.layers
    return share * (8 * dims.experts.count + 2 * dims.experts.per_token * dims.hidden * s)


def final_norm_bytes_per_token(dims: ModelDims, s: int) -> int:
    """The final RMSNorm's saved tensors (and, in float32, the last layer's output it aliases), per token."""
    return (dims.hidden * s if s == 4 else 0) + 8 * dims.hidden + 4


def layer_transient_bytes_per_token(dims: ModelDims, s: int) -> int:
    """The largest moment inside one layer without gradients: the input and the residual, the MLP's normalized
    input, silu(gate), up and their product (the widest layer's: a MoE layer's top-k and shared experts)."""
    return 3 * dims.hidden * s + 3 * dims.widest_mlp * s


class _Moments:
    """Named terms and moments made of them; the peak is the largest moment."""

    def __init__(self):
        self.moments: list[dict[str, int]] = []

    def add(self, **terms: int) -> None:
        self.moments.append({name: int(value) for name, value in terms.items() if value})

    def peak(self) -> dict[str, int]:
        return max(self.moments, key=lambda terms: sum(terms.values()))


def _activations(dims: ModelDims, w: Workload, tokens: int, *, extra_per_layer: int = 0) -> int:
    """Saved activations of ``tokens`` tokens through every layer (``extra_per_layer`` bytes of attention added per
    attention layer)."""
    s = w.itemsize
    if w.gradient_checkpointing:
        return tokens * dims.hidden * s * dims.layers
    return tokens * layer_bytes_per_token(dims, s) * dims.layers + extra_per_layer * dims.attention_layers


def _recompute(dims: ModelDims, w: Workload, tokens: int, extra_per_layer: int = 0) -> int:
    """One layer's saved tensors, back during backward under gradient checkpointing."""
    if not w.gradient_checkpointing:
        return 0
    return tokens * layer_bytes_per_token(dims, w.itemsize) + extra_per_layer


def _head_chunk_rows(dims: ModelDims, rows: int, engine: Engine, itemsize: int) -> int:
    """Rows of one fused-head chunk: the budget over the bytes a row holds per logit in the matmul dtype
    (``kernels.fused_head.chunk_logit_bytes`` without a softcap; with one, 8 bytes a logit in fewer rows: the same
    bytes)."""
    budget = CUDA_HEAD_CHUNK_BYTES if engine.device == "cuda" else CPU_HEAD_CHUNK_BYTES
    return max(1, min(max(rows, 1), budget // (itemsize * dims.vocab)))


def _fused_head(dims: ModelDims, w: Workload, engine: Engine, scored: int, *, keep: bool = False) -> tuple[dict, dict]:
    """The library's fused head over ``scored`` rows: (forward transient, backward transient) terms. With ``keep``
    (the chunked backwards, where the logits fit: ``kernels.fused_head.keep_logits_bytes``) forward keeps every
    chunk's logits for backward instead of recomputing them: the chunk being computed is one of the kept ones, so
    only what the statistics hold beside a chunk's logits is a term of its own."""
    s, v = w.itemsize, dims.vocab
    chunk = _head_chunk_rows(dims, scored, engine, s)
    # The torch statistics (CPU, and CUDA where Triton cannot launch) hold a float32 copy beside the chunk's
    # logits, and three float32 buffers in backward. The Triton kernels work in the logits' buffer, in forward and in
    # backward, where the gradient overwrites the (recomputed or kept) logits in their dtype, the hidden states'
    # (``kernels.fused_head.chunk_logit_bytes``): the matmuls read that buffer, no cast of it is made.
    forward_per_entry, backward_per_entry = (s, s) if engine.head_statistics == "triton" else (s + 4, s + 12)
    kept = s if keep else 0
    forward = {"head chunk": chunk * v * (forward_per_entry - kept), "head input": scored * dims.hidden * s}
    if keep:
        forward["kept logits"] = scored * v * s
    if not w.train:
        return forward, {}
    backward = {
        "head chunk": chunk * v * (backward_per_entry - kept),
        "head input": scored * dims.hidden * s,
        "head input grad": scored * dims.hidden * s,
        "head weight grad (fp32)": _head_weight_grad(dims, w),
    }
    if keep:
        backward["kept logits"] = scored * v * s
    return forward, backward


def keeps_logits(dims: ModelDims, w: Workload, engine: Engine, scored: int) -> bool:
    """Whether a chunked backward's node call of ``scored`` head rows keeps its logits (``keep_logits_bytes``: 1 GiB
    on CPU, one head chunk's budget on CUDA)."""
    budget = CUDA_HEAD_CHUNK_BYTES if engine.device == "cuda" else 4 * CPU_HEAD_CHUNK_BYTES
    return scored * dims.vocab * w.itemsize <= budget


def repeats_kv_heads(dims: ModelDims, engine: Engine) -> bool:
    """Whether ``expand``'s attention holds KV heads repeated per query head on ``engine``: on the fused path, for
    grouped heads, unless the engine says its kernel takes them natively (``Engine.repeats_kv`` False; None counts
    them, the upper bound of the terms)."""
    return fused_attention_path(engine) and dims.heads > dims.kv_heads and engine.repeats_kv is not False


def fused_attention_path(engine: Engine) -> bool:
    """Whether ``expand`` takes its fused-kernel path on ``engine``'s device (``backends.expand.on_fused_path``:
    CUDA): SDPA kernels chosen by torch's rules, KV heads repeated for a kernel that rejects grouped heads, each
    layer's gathered K/V recomputed in backward instead of saved."""
    return engine.device == "cuda"


def expand_terms(dims: ModelDims, w: Workload, engine: Engine, rows: int) -> dict[str, int]:
    """``expand``'s attention memory beyond the model's activations for ``rows`` completion rows, by name (bytes;
    sizes from ``backends.expand_memory``). A grouped batch is a two-level trie: the prompts' node call (each prompt
    one node of up to P tokens, no ancestors), then the completions' (each completion one node of up to C tokens
    under its prompt's P):

    - ``prompt mask``: none: a node without ancestors runs causal SDPA (padding after a node's tokens is hidden by
      causality), unless a window shorter than the prompt hides keys (then one mask per prompt);
    - ``row masks``: the completions' masks, one per row, or one row's shared by all when every prompt has P real
      tokens and no window hides a key;
    - ``gathered K/V (one layer)``: each row's [prompt ; own] keys and values;
    - ``repeated K/V (one layer)``, ``prompt repeated K/V (one layer)``: on the fused path with grouped heads, the
      rows' and the prompts' keys and values repeated to every query head. Counted unless ``Engine.repeats_kv``
      says the kernel takes grouped heads natively (which depends on the GPU, torch and cuDNN): an upper bound.

    Masks are allocated with their key dim rounded up to a multiple of 16 (``expand_memory.MASK_ALIGNMENT``), so
    that SDPA's memory-efficient kernel does not copy them in every layer.
    """
    shape = attention_shape(dims, w)
    p, c = w.prompt_len, w.completion_len
    rows_masked = w.padded_prompts or dims.windowed(p + c)
    repeats = repeats_kv_heads(dims, engine)
    return {
        "prompt mask": w.prompts * mask_bytes(p, p, w.itemsize) if dims.windowed(p) else 0,
        "row masks": (rows if rows_masked else 1) * mask_bytes(c, p + c, w.itemsize),
        "gathered K/V (one layer)": rows * kv_bytes(shape, dims.kv_heads, p + c),
        "repeated K/V (one layer)": rows * kv_bytes(shape, dims.heads, p + c) if repeats else 0,
        "prompt repeated K/V (one layer)": w.prompts * kv_bytes(shape, dims.heads, p) if repeats else 0,
    }


def attention_shape(dims: ModelDims, w: Workload) -> AttentionShape:
    """The sizes ``backends.expand_memory`` computes its terms from (no explicit scores: see ``plan_memory``)."""
    return AttentionShape(
        hidden_size=dims.hidden,
        heads=dims.heads,
        kv_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        v_head_dim=dims.v_head_dim,
        itemsize=w.itemsize,
        explicit_scores=False,
        sliding_window=dims.sliding_window,
    )


def _packed_kv_bytes(dims: ModelDims, w: Workload, prompt_tokens: int, row_tokens: int) -> int:
    """flex's keys and values of one completions' layer: [prompts ; completions] packed in one tensor (a copy of the
    prompts' captured keys/values), its length rounded up to the 128-token blocks of the masks (``backends.flex``)."""
    length = -(-(prompt_tokens + row_tokens) // FLEX_BLOCK) * FLEX_BLOCK
    return length * dims.kv_heads * (dims.head_dim + dims.v_head_dim) * w.itemsize


def _model_state(dims: ModelDims, w: Workload, engine: Engine) -> dict[str, int]:
    """Parameters, gradients and optimizer states per device (``cuda``); gradients only on ``cpu``."""
    s, world = w.itemsize, engine.world_size
    trainable = dims.params if w.lora_fraction is None else int(dims.params * w.lora_fraction)
    terms = {}
    if engine.device == "cuda":
        terms["parameters"] = dims.params * s // world
        if engine.kind != "single":
            terms["unsharded layer"] = dims.layer_params * s
        if w.train:
            terms["optimizer states"] = trainable * OPTIMIZER_STATE_BYTES[w.optimizer] // world
        if w.train:
            terms["gradients"] = trainable * s // world
    return terms


def _head_weight_grad(dims: ModelDims, w: Workload) -> int:
    """The LM head's float32 weight gradient; none under LoRA, where the head is frozen."""
    return 4 * dims.vocab * dims.hidden if w.lora_fraction is None else 0


def _trainable(dims: ModelDims, w: Workload) -> int:
    return dims.params if w.lora_fraction is None else int(dims.params * w.lora_fraction)


def _end_of_backward(dims: ModelDims, w: Workload, engine: Engine, *, accumulating: bool = False) -> dict[str, int]:
    """The last moment of backward on ``cpu``: every gradient allocated and, with tied weights, the head's and the
    embedding's gradients of the shared weight held until autograd sums them (the sum becomes its ``.grad``, or,
    ``accumulating`` into an existing ``.grad`` as chunks do, is a third tensor). On ``cuda`` the gradients are in
    every moment already."""
    if engine.device != "cpu" or not w.train:
        return {}
    terms = {"gradients": _trainable(dims, w) * w.itemsize}
    if dims.tied:
        terms["head and embedding grads"] = (3 if accumulating else 2) * dims.vocab * dims.hidden * w.itemsize
    return terms


def _dense_like(dims: ModelDims, w: Workload, engine: Engine, method: str) -> _Moments:
    s, v, rows, c = w.itemsize, dims.vocab, w.rows, w.completion_len
    width = w.prompt_len + c
    tokens = rows * width
    m = _Moments()
    mask = rows * width * width  # transformers' (rows, 1, T, T) boolean padding mask
    if method == "dense":
        # No prompt pads and no padding mask (``bench.methods``): prompts of one real length are forwarded
        # together. With gradients every group's activations stay alive; without, one group at a time, the
        # longest prompt's the largest.
        mask = 0
        if w.train:
            tokens = w.dense_row_tokens
        else:
            rows = w.largest_dense_bucket_rows
            tokens = rows * width
        # One group's head: ``model(...).logits[:, :-1].float()`` then ``log_softmax``. In half precision the float32
        # copy is made while the model's logits exist, and those, referenced by nothing once the statement ends, are
        # freed before the log-softmax allocates its output; in float32 ``.float()`` is the logits themselves. What
        # the log-softmax read stays referenced by the method's ``logits`` until the next group's replace it, or
        # the step returns (through backward, for the last group: the longest prompt's, the largest).
        group = w.largest_dense_bucket_rows
        keep, log_probs = group * (c + 1) * v * s, group * c * v * 4
        read = log_probs if s != 4 else keep
        read_name = "fp32 logits copy" if s != 4 else "logits"
        # An earlier group's (the groups are one prompt's G rows each when lengths differ) is still referenced
        # while the next group's logits are made.
        previous = read if group < w.rows else 0
        head_forward = {"previous group's logits": previous, "logits": keep, "fp32 logits copy": read if s != 4 else 0}
        # With gradients every group's log-softmax output is saved for backward; backward runs the last group's
        # first: the gradient of its gather and of its log-softmax, each the size of its log-probs.
        saved = rows * c * v * 4 if w.train else log_probs
        head_after = {read_name: read, "fp32 log-probs": saved}
        head_backward = {read_name: read, "fp32 log-probs": saved, "fp32 log-prob grads": 2 * log_probs}
        head_weight_backward = {
            read_name: read,
            "logits grad": keep,
            "head weight grad": _head_weight_grad(dims, w) * s // 4,
        }
        if w.train:
            head_forward["fp32 log-probs"] = saved - log_probs  # the earlier groups'
    else:
        # TRL's fused head: every position where Triton is not used (CPU), the scored ones on CUDA; a
        # (min(N, 4096), 32768) matmul buffer whatever V is, and the torch fallback's float32 temporaries over the
        # tile's V columns (forward: the transformed logits, their shift and exp; backward: about eight).
        positions = tokens - rows if engine.device == "cpu" else w.scored
        tile_rows, tile_cols = min(positions, TRL_TOKEN_TILE), min(v, TRL_VOCAB_TILE)
        buffer = tile_rows * TRL_VOCAB_TILE * s
        cpu = engine.device == "cpu"
        head_forward = {
            "head tile buffer": buffer,
            "head tile temporaries (fp32)": tile_rows * tile_cols * 12 if cpu else 0,
            "head input": positions * dims.hidden * s,
        }
        head_after = {}
        head_backward = {
            "head tile buffer": buffer,
            "head tile temporaries (fp32)": tile_rows * tile_cols * 33 if cpu else 0,
            "head input": positions * dims.hidden * s,
            "head input grad (fp32)": positions * dims.hidden * 4,
            "head weight grad (fp32)": _head_weight_grad(dims, w),
        }
        head_weight_backward = {}
    if not w.train:
        body = tokens * layer_transient_bytes_per_token(dims, s) + (tokens * dims.hidden * s if dims.layers > 1 else 0)
        # dense's groups run shortest prompt first; an earlier group's logits stay referenced until the next
        # group's forward returns, so the longest prompt's forward runs beside them.
        previous = head_forward.get("previous group's logits", 0) if method == "dense" else 0
        m.add(**{"layer transient": body, "attention mask": mask, "previous group's logits": previous})
        # The decoder's hidden states are gone once the model returns its logits; TRL's head reads them.
        m.add(**head_forward)
        m.add(**head_after)
        return m
    acts = {
        "activations": _activations(dims, w, tokens) + tokens * final_norm_bytes_per_token(dims, s),
        "attention mask": mask,
    }
    m.add(**acts, **head_forward)
    m.add(**acts, **head_after)
    m.add(**acts, **head_backward)
    m.add(**acts, **head_weight_backward, **{"recomputed layer": _recompute(dims, w, tokens)})
    if method == "dense" and engine.device == "cpu":
        # The last group's logits stay referenced by the step until it returns, through the end of backward.
        m.add(**_end_of_backward(dims, w, engine), **{"last group's logits": read})
    return m


def _expand_saved(
    dims: ModelDims, s: int, tokens: int, nodes: int, width: int, ancestors: int, fused: bool, repeats: bool
) -> int:
    """Bytes one layer of an ``expand`` node call saves for backward beyond :func:`layer_bytes_per_token` of its
    ``tokens`` packed tokens: its ``nodes`` padded to ``width`` queries, each over ``ancestors`` ancestor tokens.

    SDPA saves its padded query and output (the packed output, a copy, is the output projection's input) and, where
    the query is padded, a log-sum-exp per padded slot; on CPU the keys/values it attended over ([ancestors ; own]
    per node). A call without ancestors keeps its packed keys/values (the states later calls attend over), a leaf
    call does not. On the fused path a call with ancestors is recomputed in backward: it saves its packed inputs
    and no log-sum-exp; one without saves the keys/values repeated per query head (``prompt repeated K/V``) or,
    without a repeat, its padded keys/values.
    """
    padded = nodes * width
    kv = dims.kv_heads * (dims.head_dim + dims.v_head_dim) * s
    if fused and ancestors:
        return -tokens * 4 * dims.heads
    query = (padded - tokens) * (dims.heads * dims.head_dim * s + 4 * dims.heads)
    output = padded * dims.heads * dims.v_head_dim * s
    if ancestors:
        keys = nodes * (ancestors + width) * kv - tokens * kv  # the gathered copies; the leaf's own are freed
    else:
        keys = 0 if repeats else padded * kv
    return query + output + keys


def scoring_chunk(dims: ModelDims, w: Workload, engine: Engine, method: str) -> tuple[int, int]:
    """(prompts, rows) of the largest chunk a no-grad call takes within the token budget (``Workload.token_budget``,
    else the default): rows go in depth-first order (a prompt's G rows together), and a chunk counts its prompts'
    nodes and its rows' nodes at the call's largest, memory terms included (``engine.budget``, ``expand`` only; the
    packed layouts count tokens)."""
    from ..engine.budget import DEFAULT_TOKEN_BUDGET, NodeCosts

    p, c = w.prompt_len, w.completion_len
    costs = NodeCosts(None)
    if method != "flex":
        costs = NodeCosts(attention_shape(dims, w), repeats_kv=repeats_kv_heads(dims, engine))
    shared = not (w.padded_prompts or dims.windowed(p + c))
    per_prompt = costs.node_tokens(0, p)
    per_row = costs.node_tokens(p, c, own_mask=not shared)
    fixed = costs.calls_tokens({1: (1, p, p, c, c)}) - per_row if shared else 0  # the one shared mask row
    largest = (0, 0)
    prompts = rows = 0
    for row in range(w.rows):
        first = row % w.generations == 0  # the row's prompt joins the chunk
        cost = (prompts + first) * per_prompt + (rows + 1) * per_row + fixed
        if rows and cost > (w.token_budget or DEFAULT_TOKEN_BUDGET):
            largest = max(largest, (rows, prompts))
            prompts, rows, first = 0, 0, True
        prompts += first
        rows += 1
    rows, prompts = max(largest, (rows, prompts))
    return prompts, rows


def _shared(dims: ModelDims, w: Workload, engine: Engine, method: str) -> _Moments:
    """The node calls of a grouped batch's two-level trie (the prompts' call, then the completions'), without
    gradients chunked by the token budget, with them in one graph, or (``chunked``) the prompts' call alive across
    the chunks of generations, each chunk's call back-propagated before the next."""
    s, p, c = w.itemsize, w.prompt_len, w.completion_len
    kv_per_token = dims.kv_heads * (dims.head_dim + dims.v_head_dim) * s
    fused = fused_attention_path(engine)
    m = _Moments()
    prompt_share, row_share = w.real_prompt_tokens / w.prompts, w.scored / w.rows  # real tokens per prompt, per row
    if not w.train:
        prompts, rows = scoring_chunk(dims, w, engine, method)
    elif method == "chunked":
        prompts, rows = w.prompts, w.prompts * w.chunk_generations
    else:
        prompts, rows = w.prompts, w.rows
    prompt_tokens, row_tokens = round(prompts * prompt_share), round(rows * row_share)
    extra = expand_terms(dims, w, engine, rows)
    extra["prompt repeated K/V (one layer)"] = extra["prompt repeated K/V (one layer)"] * prompts // w.prompts
    extra["prompt mask"] = extra["prompt mask"] * prompts // w.prompts
    if method == "flex":  # packed: no per-node copies, no dense masks
        extra = dict.fromkeys(extra, 0)
    # A call's masks are cached on its context; with gradients they live until its backward.
    masks = {name: extra[name] for name in ("prompt mask", "row masks")}
    gathered = {name: extra[name] for name in ("gathered K/V (one layer)", "repeated K/V (one layer)")}
    prompt_repeated = extra["prompt repeated K/V (one layer)"]
    packed = {"packed K/V (one layer)": _packed_kv_bytes(dims, w, prompt_tokens, row_tokens) if method == "flex" else 0}
    # What the completions attend over (attention layers) and start from (a hybrid's Gated DeltaNet layers: each
    # prompt's end state, gathered per row into the completions' initial states).
    states = 0 if dims.linear is None else dims.linear_layers * dims.linear.state_bytes(s)
    stored = {
        "stored prompt K/V": prompt_tokens * kv_per_token * dims.attention_layers,
        "prompt recurrent states": prompts * states,
        "row initial states": rows * states,
    }
    # The plan's and the calls' integer tensors: about 20 int64 per token (the trie, the scored pairs, where results
    # go, the calls' packing), and expand's index of every (row, ancestor token).
    book = {"plan and call indices": (prompt_tokens + row_tokens) * 160 + (rows * p * 9 if method != "flex" else 0)}
    # The prompts' call scores the first token of each row (its last token predicts it), the completions' the rest.
    scored = max(row_tokens - rows, 0)
    if not w.train:
        m.add(
            **book,
            **{
                "layer transient": prompt_tokens * layer_transient_bytes_per_token(dims, s),
                "prompt mask": masks["prompt mask"],
                "prompt repeated K/V (one layer)": prompt_repeated,
            },
        )
        # The completions' call is a leaf call: no later call attends over it, it keeps no keys/values.
        transient = {"layer transient": row_tokens * layer_transient_bytes_per_token(dims, s)}
        m.add(**book, **stored, **transient, **gathered, **packed, **{"row masks": masks["row masks"]})
        head_forward, _ = _fused_head(dims, w, engine, scored)
        last = {"last hidden states": row_tokens * dims.hidden * s, "row masks": masks["row masks"]}
        m.add(**book, **stored, **last, **head_forward)
        return m
    if method == "flex":
        # flex_attention saves each layer's packed keys/values in place of the rows' own.
        prompt_extra = 0
        row_extra = packed["packed K/V (one layer)"] - row_tokens * kv_per_token
    else:
        repeats = repeats_kv_heads(dims, engine)
        prompt_extra = _expand_saved(dims, s, prompt_tokens, prompts, p, 0, fused, repeats)
        row_extra = _expand_saved(dims, s, row_tokens, rows, c, p, fused, repeats)
    # The prompts' call runs the final norm over every prompt token (its head reads the last token of each).
    prompt_final_norm = prompt_tokens * (final_norm_bytes_per_token(dims, s) - dims.hidden * s)
    prompt_acts = _activations(dims, w, prompt_tokens, extra_per_layer=prompt_extra) + prompt_final_norm
    row_acts = _activations(dims, w, row_tokens, extra_per_layer=row_extra)
    acts = {
        "prompt activations": prompt_acts,
        "completion activations": row_acts + row_tokens * final_norm_bytes_per_token(dims, s),
        # The prompts' SDPA saves the repeated keys/values it was given, in every layer (one recomputed layer at a
        # time under gradient checkpointing, after the completions' backward).
        "prompt repeated K/V (saved)": 0 if w.gradient_checkpointing else prompt_repeated * dims.attention_layers,
        "prompt recurrent states": stored["prompt recurrent states"],
        "row initial states": stored["row initial states"],
        **masks,
        **book,
    }
    earlier = {}
    keep = method == "chunked" and keeps_logits(dims, w, engine, scored)
    buffers = _weight_grad_buffers(dims, w, engine) if method == "chunked" else 0
    if method == "chunked":
        acts["prompt K/V grads"] = prompt_tokens * kv_per_token * dims.attention_layers
        acts["prompt recurrent state grads"] = prompts * states
        acts["head and embedding grad buffers (fp32)"] = buffers
        if rows < w.rows and engine.device == "cpu":
            # From the second chunk on, every parameter's .grad holds the earlier chunks' sum (the head's and the
            # embedding's go to their buffers instead).
            earlier = {"gradients": _trainable(dims, w) * s - (buffers * s // 4)}
    head_forward, head_backward = _fused_head(dims, w, engine, scored, keep=keep)
    if buffers:
        head_backward.pop("head weight grad (fp32)", None)  # the fused head adds it into the buffer
    recomputed = {"recomputed layer": _recompute(dims, w, row_tokens)}
    m.add(**acts, **head_forward, **earlier)
    m.add(**acts, **head_backward, **earlier, **recomputed)
    if fused and method != "flex":
        # The last layer's attention backward: SDPA's backward holds the keys/values it attended over, recomputed,
        # beside their gradients. With a repeat those are the repeated ones (the gathered copies they were made
        # from are freed before, and their gradients come after the repeated ones are freed).
        name = "repeated K/V" if gathered["repeated K/V (one layer)"] else "gathered K/V"
        size = gathered[f"{name} (one layer)"]
        m.add(**acts, **earlier, **recomputed, **{f"{name} (one layer)": size, f"{name} grads (one layer)": size})
    if method == "chunked" and engine.device == "cpu":
        # The last backward, through the prompts' call: its activations and K/V gradients beside every gradient;
        # then each buffer is handed to its parameter (in float32 it becomes the .grad, else a cast beside it).
        end = _end_of_backward(dims, w, engine, accumulating=rows < w.rows)
        if buffers:
            end.pop("head and embedding grads", None)
            end["head and embedding grad buffers (fp32)"] = buffers if s != 4 else 0
        m.add(**{"prompt activations": prompt_acts, "prompt K/V grads": acts["prompt K/V grads"]}, **end)
    return m


def _weight_grad_buffers(dims: ModelDims, w: Workload, engine: Engine) -> int:
    """The chunked backwards' float32 buffers of the head's and the embedding's weight gradients (one for a tied
    weight), alive through the call (``engine.weight_grads``: a model trained in full on one device, not sharded)."""
    if w.lora_fraction is not None or engine.kind != "single":
        return 0
    return (1 if dims.tied else 2) * 4 * dims.vocab * dims.hidden


def plan_memory(method: str, dims: ModelDims, workload: Workload, engine: Engine) -> MemoryPlan:
    """Predicted peak bytes per device of ``method`` on ``workload``, with its terms.

    Raises:
        ValueError: an unknown method.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    moments = (_dense_like if method in ("dense", "trl") else _shared)(dims, workload, engine, method)
    if method == "expand" and not workload.train and engine.repeats_kv is None and repeats_kv_heads(dims, engine):
        # Not known whether the kernel repeats the KV heads: a repeat makes each row cost more of the token budget,
        # so chunks hold fewer rows. The peak is the larger of the two cuts' (each with its own terms).
        moments.moments += _shared(dims, workload, replace(engine, repeats_kv=False), method).moments
    moments.add(**_end_of_backward(dims, workload, engine))
    state = _model_state(dims, workload, engine)
    terms = {**state, **moments.peak()}
    every = tuple({**state, **moment} for moment in moments.moments)
    return MemoryPlan(method, sum(terms.values()), terms, every)

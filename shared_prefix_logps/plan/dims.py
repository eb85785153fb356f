"""The sizes of a decoder-only model that its memory and FLOPs depend on, from a config or a bench preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

#: Config fields every prediction needs (``head_dim``, ``num_key_value_heads`` and ``tie_word_embeddings`` have
#: defaults, as in transformers). ``intermediate_size``, the dense MLP's width, is needed only by a config with a
#: dense MLP layer: a family whose every layer is routed (Qwen3.5-MoE) has no such field.
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)

#: Config fields that count routed experts, in the families' own names; a config with one of them set above zero is
#: a mixture-of-experts model.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")

#: Mixture-of-experts families whose layout :func:`experts_from_config` knows: which layers route, the experts'
#: width, shared experts and routers. Configs with expert counts of any other type are refused by name.
MOE_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
)

#: Mixture-of-experts families whose every decoder layer is routed, whatever ``decoder_sparse_step`` or
#: ``mlp_only_layers`` say (transformers builds their layers' MLP as the sparse block unconditionally): their configs
#: have no dense ``intermediate_size``.
ALL_ROUTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

#: Linear-attention hybrids whose Gated DeltaNet layers :class:`LinearAttention` sizes (the families the library
#: forks recurrent states of): their configs' ``linear_attention`` layers are planned, their attention layers are
#: gated (the query projection also yields a sigmoid gate on the attention output).
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

#: The chunk length of transformers' chunked Gated DeltaNet kernel (``torch_chunk_gated_delta_rule``'s default, also
#: flash-linear-attention's): the recurrence's intra-chunk matmuls grow with it.
GDN_CHUNK = 64

#: Decoder-layer norms per family beyond the usual two (input and post-attention): Gemma2/3 and GLM4 norm before and
#: after both blocks; Cohere's parallel block has one.
NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "glm4": 4, "cohere": 1, "cohere2": 1}


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts MLPs of a model.

    Attributes:
        count: routed experts per MoE layer; per_token: experts each token is routed to (top-k).
        intermediate: one routed expert's gated-MLP width.
        shared_intermediate: width of the shared expert(s) every token also goes through (0: none).
        shared_gate: a (1, H) sigmoid gate on the shared expert's output (Qwen2-MoE).
        bias: the experts' projections have biases (GPT-OSS); router_bias: so does the router.
        layers: indices of the decoder layers whose MLP is routed; the others are dense of the config's
            ``intermediate_size``.
    """

    count: int
    per_token: int
    intermediate: int
    layers: tuple[int, ...]
    shared_intermediate: int = 0
    shared_gate: bool = False
    bias: bool = False
    router_bias: bool = False

    def mlp_params(self, hidden: int) -> int:
        """Parameters of one MoE layer's MLP: every routed expert, the shared expert(s) and their gate, the router."""
        expert = 3 * hidden * self.intermediate + ((2 * self.intermediate + hidden) if self.bias else 0)
        router = self.count * hidden + (self.count if self.router_bias else 0)
        shared = 3 * hidden * self.shared_intermediate + (hidden if self.shared_gate else 0)
        return self.count * expert + shared + router

    @property
    def active_intermediate(self) -> int:
        """Gated-MLP width one token goes through in a MoE layer: its top-k experts and the shared ones."""
        return self.per_token * self.intermediate + self.shared_intermediate


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V3): queries and keys/values through low-rank projections.

    Attributes:
        q_rank: rank of the query projection (0: a full-rank query projection); kv_rank: of the key/value one.
        rope_dim: the rotary part of each key head, shared by the heads (the rest, ``head_dim - rope_dim``, per head).
    """

    q_rank: int
    kv_rank: int
    rope_dim: int


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a linear-attention hybrid (Qwen3.5, Qwen3-Next).

    Attributes:
        layers: indices of the decoder layers that are Gated DeltaNet (the others are attention layers).
        key_heads, value_heads: the recurrence's key and value heads (keys repeated to the value heads);
        key_dim, value_dim: their head sizes; conv_kernel: the short convolution's kernel.
    """

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: the queries', keys' and values' projections."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def weights(self, hidden: int) -> int:
        """Weights of one layer's matmuls (2 FLOPs per token each): q/k/v, the output gate z, beta and the decay
        projections in, the output projection out."""
        value_width = self.value_heads * self.value_dim
        return hidden * (self.conv_channels + value_width + 2 * self.value_heads) + value_width * hidden

    def params(self, hidden: int) -> int:
        """Parameters of one layer: :meth:`weights`, the depthwise convolution, the per-head decay ``A_log`` and
        ``dt_bias``, the gated RMSNorm over each value head."""
        return self.weights(hidden) + self.conv_channels * self.conv_kernel + 2 * self.value_heads + self.value_dim

    @property
    def recurrence_flops_per_token(self) -> int:
        """Forward FLOPs of one token's recurrence: the matmuls of transformers' chunked kernel (chunks of
        :data:`GDN_CHUNK` tokens, per value head), as ``FlopCounterMode`` counts them: the chunk's key-key and
        query-key products (2 C dk each a token), its weights times the corrected values (2 C dv), its reads and
        update of the dk x dv state (6 dk dv); and the depthwise convolution, 2 K per channel. The kernel's two
        triangular solves (about C (dk + dv) a token) are not matmuls and are left out, as the counter does."""
        k, v = self.key_dim, self.value_dim
        per_head = 4 * GDN_CHUNK * k + 2 * GDN_CHUNK * v + 6 * k * v
        return self.value_heads * per_head + 2 * self.conv_channels * self.conv_kernel

    def state_bytes(self, itemsize: int) -> int:
        """Bytes of one node's state in one layer: the float32 ``value_heads x key_dim x value_dim`` recurrence
        state and the convolution's last ``conv_kernel - 1`` inputs in the model's dtype."""
        return (
            4 * self.value_heads * self.key_dim * self.value_dim
            + self.conv_channels * (self.conv_kernel - 1) * itemsize
        )

    def saved_bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token saves for backward in one Gated DeltaNet layer (transformers' torch kernels, read from
        their ops; approximate): the convolution's input and output and the activated q/k/v, the output gate, the
        float32 queries, keys, values and per-head decays of the chunked kernel, its float32 output, and the gated
        norm's input and output."""
        value_width = self.value_heads * self.value_dim
        keys = self.value_heads * self.key_dim  # keys and queries repeated to the value heads in the kernel
        float32 = 2 * keys + 2 * value_width + 4 * self.value_heads
        return (3 * self.conv_channels + 3 * value_width) * itemsize + 4 * float32


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a Llama/Qwen-style decoder (gated MLP, RMSNorm, grouped-query or latent attention), dense or with
    routed experts.

    Attributes:
        hidden, layers, heads, kv_heads, head_dim, v_head_dim, intermediate, vocab: the config's sizes
            (``intermediate``: the dense layers' MLP width; 0 for a model without a dense MLP layer).
        tied: whether the LM head shares the embedding's weight.
        qkv_bias: whether q/k/v projections have a bias (Qwen2).
        sliding_window: the config's sliding window (None: none); a window shorter than the keys makes ``expand``
            build masks even for unpadded prompts.
        name: where the sizes came from (a preset name or a path), for reports.
        norms_per_layer: RMSNorms of a decoder layer (their H weights each).
        attention_extra: other parameters of one attention block: q/k norms, an output bias, attention sinks.
        experts: the routed experts (None: a dense model).
        latent: multi-head latent attention's ranks (None: q/k/v projections of their heads).
        linear: a linear-attention hybrid's Gated DeltaNet layers (None: every layer is attention).
        attention_gate: the query projection also yields a sigmoid gate on the attention output (Qwen3.5,
            Qwen3-Next), doubling its width.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    sliding_window: int | None = None
    name: str = "config"
    norms_per_layer: int = 2
    attention_extra: int = 0
    experts: Experts | None = None
    latent: LatentAttention | None = None
    linear: LinearAttention | None = None
    attention_gate: bool = False

    @property
    def linear_layers(self) -> int:
        """Decoder layers that are Gated DeltaNet (0 for a model of attention layers only)."""
        return 0 if self.linear is None else len(self.linear.layers)

    @property
    def attention_layers(self) -> int:
        """Decoder layers with attention: the layers whose keys/values a prefix hands its descendants."""
        return self.layers - self.linear_layers

    @property
    def mixer_weights(self) -> float:
        """Weights of one layer's token mixer (attention or Gated DeltaNet) matmuls, averaged over the layers."""
        linear = 0 if self.linear is None else self.linear_layers * self.linear.weights(self.hidden)
        return (self.attention_layers * self.attention_weights + linear) / self.layers

    @property
    def attention_weights(self) -> int:
        """Weights of one attention block's matmuls (2 FLOPs per token each)."""
        out = self.heads * self.v_head_dim * self.hidden
        if self.latent is not None:
            rank_q, rank_kv, rope = self.latent.q_rank, self.latent.kv_rank, self.latent.rope_dim
            query_width = self.heads * self.head_dim
            query = self.hidden * rank_q + rank_q * query_width if rank_q else self.hidden * query_width
            keys_values = self.hidden * (rank_kv + rope) + rank_kv * self.heads * (
                self.head_dim - rope + self.v_head_dim
            )
            return query + keys_values + out
        q = self.heads * self.head_dim * (2 if self.attention_gate else 1)
        kv = self.kv_heads * (self.head_dim + self.v_head_dim)
        return self.hidden * (q + kv) + out

    @property
    def attention_params(self) -> int:
        """Parameters of one attention block: its matmuls, q/k/v biases, latent norms and :attr:`attention_extra`."""
        params = self.attention_weights + self.attention_extra
        if self.latent is not None:
            params += self.latent.q_rank + self.latent.kv_rank  # the low-rank parts' norms
        elif self.qkv_bias:
            params += self.heads * self.head_dim + self.kv_heads * (self.head_dim + self.v_head_dim)
        return params

    @property
    def mixer_params(self) -> int:
        """Parameters of the largest token mixer (an attention block, or a Gated DeltaNet layer)."""
        linear = 0 if self.linear is None else self.linear.params(self.hidden)
        return max(self.attention_params if self.attention_layers else 0, linear)

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is routed."""
        return 0 if self.experts is None else len(self.experts.layers)

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what an FSDP unit holds unsharded): attention, MLP, norms."""
        mlp = self.dense_mlp_params if self.moe_layers < self.layers else 0
        if self.experts is not None:
            mlp = max(mlp, self.experts.mlp_params(self.hidden))
        return self.mixer_params + mlp + self.norms_per_layer * self.hidden

    @property
    def params(self) -> int:
        """All parameters: embedding, layers (every expert of every MoE layer; attention or Gated DeltaNet), final
        norm and (untied) LM head."""
        embedding = self.vocab * self.hidden
        linear = 0 if self.linear is None else self.linear_layers * self.linear.params(self.hidden)
        mixers = self.attention_layers * self.attention_params + linear
        per_layer = self.norms_per_layer * self.hidden
        mlp = (self.layers - self.moe_layers) * self.dense_mlp_params
        if self.experts is not None:
            mlp += self.moe_layers * self.experts.mlp_params(self.hidden)
        return embedding * (1 if self.tied else 2) + self.layers * per_layer + mixers + mlp + self.hidden

    @property
    def mlp_width(self) -> float:
        """Gated-MLP width one token goes through per layer, averaged over the layers: the dense width, or in MoE
        layers its top-k experts' and the shared ones' (what FLOPs and activations grow with)."""
        if self.experts is None:
            return self.intermediate
        dense = (self.layers - self.moe_layers) * self.intermediate
        return (dense + self.moe_layers * self.experts.active_intermediate) / self.layers

    @property
    def widest_mlp(self) -> int:
        """The largest per-token gated-MLP width of a layer (dense, or a MoE layer's routed and shared experts)."""
        dense = self.intermediate if self.moe_layers < self.layers else 0
        return max(dense, self.experts.active_intermediate if self.experts is not None else 0)

    @property
    def router_width(self) -> float:
        """Router logits per token per layer, averaged over the layers (0 for a dense model)."""
        return 0 if self.experts is None else self.experts.count * self.moe_layers / self.layers

    def windowed(self, keys: int) -> bool:
        """Whether the sliding window hides some of ``keys`` keys from a query (``AttentionShape.windowed``)."""
        return self.sliding_window is not None and self.sliding_window < keys

    def with_layers(self, layers: int | None) -> ModelDims:
        """The same model with ``layers`` decoder layers (None: unchanged), as ``bench --layers`` builds it: the first
        ``layers`` of them, routed where the full model's are."""
        if layers is None:
            return self
        _positive("layers", layers)
        experts, linear = self.experts, self.linear
        if experts is not None:
            experts = replace(experts, layers=tuple(i for i in experts.layers if i < layers))
        if linear is not None:
            linear = replace(linear, layers=tuple(i for i in linear.layers if i < layers))
        return replace(self, layers=layers, experts=experts, linear=linear)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _field(config: dict, name: str, field: str, *, default=None, minimum: int = 1):
    """The config's integer ``field`` (``default`` when absent or null), checked: an int (JSON numbers with a
    fraction, strings and booleans are refused) of at least ``minimum``.

    Raises:
        ValueError: naming the config and the field.
    """
    value = config.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"config {name!r}: field {field!r} must be {kind}, got {value!r}")
    return value


def _layer_kinds(config: dict, name: str, layers: int) -> list[str] | None:
    """The config's ``layer_types`` (None when it has none), checked as transformers checks it: a list of layer
    kinds, one per decoder layer.

    Raises:
        ValueError: naming ``layer_types`` when it is not a list of strings or its length is not the layer count.
    """
    kinds = config.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, (list, tuple)) or not all(isinstance(kind, str) for kind in kinds):
        raise ValueError(f"config {name!r}: field 'layer_types' must be a list of layer kinds, got {kinds!r}")
    if len(kinds) != layers:
        raise ValueError(
            f"config {name!r}: field 'layer_types' lists {len(kinds)} layers for num_hidden_layers={layers}; "
            "it needs one kind per decoder layer"
        )
    return list(kinds)


def _refuse_unmodelled_layers(config: dict, name: str) -> None:
    """Layers that are neither softmax attention nor the Gated DeltaNet layers of :data:`LINEAR_ATTENTION_MODEL_TYPES`
    (other linear attention, state-space mixers) are refused by name: the plan has no terms for them, and the library
    refuses such models."""
    kinds = _layer_kinds(config, name, _field(config, name, "num_hidden_layers"))
    if kinds is not None:
        known = {"full_attention", "sliding_attention", "chunked_attention"}
        if config.get("model_type") in LINEAR_ATTENTION_MODEL_TYPES:
            known.add("linear_attention")
        other = sorted(set(kinds) - known)
        if other:
            raise ValueError(
                f"config {name!r} (model type {config.get('model_type')!r}) has {', '.join(other)} layers; plan models "
                "softmax-attention decoders and the Gated DeltaNet hybrids "
                f"({', '.join(LINEAR_ATTENTION_MODEL_TYPES)}) only (and the library refuses such models)"
            )


def linear_from_config(config: dict, name: str) -> LinearAttention | None:
    """:class:`LinearAttention` of a Gated DeltaNet hybrid's config (None for any other): its ``linear_attention``
    layers from ``layer_types``, or every ``full_attention_interval``-th layer attention (transformers' default, 4)
    where the config lists none.

    Raises:
        ValueError: a missing or malformed linear-attention field, named: sizes that are not positive integers,
            ``layer_types`` not one kind per layer, value heads that are not a multiple of the key heads (the layer
            repeats each key head over a group of value heads).
    """
    if config.get("model_type") not in LINEAR_ATTENTION_MODEL_TYPES:
        return None
    layers = _field(config, name, "num_hidden_layers")
    kinds = _layer_kinds(config, name, layers)
    if kinds is None:
        interval = _field(config, name, "full_attention_interval", default=4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    missing = [field for field in fields if config.get(field) is None]
    if missing:
        raise ValueError(f"config {name!r}: a Gated DeltaNet hybrid's config needs {', '.join(missing)}")
    key_heads = _field(config, name, "linear_num_key_heads")
    value_heads = _field(config, name, "linear_num_value_heads")
    if value_heads % key_heads:
        raise ValueError(
            f"config {name!r}: field 'linear_num_value_heads' ({value_heads}) must be a multiple of "
            f"'linear_num_key_heads' ({key_heads}): each key head serves a group of value heads"
        )
    return LinearAttention(
        layers=tuple(i for i in range(layers) if kinds[i] == "linear_attention"),
        key_heads=key_heads,
        value_heads=value_heads,
        key_dim=_field(config, name, "linear_key_head_dim"),
        value_dim=_field(config, name, "linear_value_head_dim"),
        conv_kernel=_field(config, name, "linear_conv_kernel_dim", default=4),
    )


def _layer_indices(config: dict, name: str, field: str, layers: int) -> set[int]:
    """The config's list of decoder-layer indices ``field`` (empty when absent), each in ``[0, layers)``.

    Raises:
        ValueError: naming ``field`` when it is not a list of such indices.
    """
    value = config.get(field)
    if value is None:
        return set()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value
    ):
        raise ValueError(
            f"config {name!r}: field {field!r} must be a list of layer indices in [0, {layers}) "
            f"(num_hidden_layers={layers}), got {value!r}"
        )
    return set(value)


def experts_from_config(config: dict, name: str) -> Experts | None:
    """:class:`Experts` of a mixture-of-experts config (None for a dense one), laid out as its family lays them out
    in transformers.

    Raises:
        ValueError: a config with expert counts of a family not in :data:`MOE_MODEL_TYPES` (not planned as dense),
            or a malformed expert field, named: a size that is not a positive integer, more experts per token than
            experts, layer indices outside the model, expert groups that do not divide the experts.
    """
    counts = {field: _field(config, name, field, minimum=0) for field in EXPERT_COUNT_FIELDS}
    count_field, count = next(((field, value) for field, value in counts.items() if value), (None, 0))
    model_type = config.get("model_type")
    if model_type in ALL_ROUTED_MODEL_TYPES and not count:
        raise ValueError(
            f"config {name!r}: a {model_type} config needs 'num_experts' (a positive integer): every one of its "
            "layers is routed"
        )
    if not count:
        return None
    if model_type not in MOE_MODEL_TYPES:
        fields = ", ".join(f"{field}={value}" for field, value in counts.items() if value)
        raise ValueError(
            f"config {name!r}: model type {model_type!r} has routed experts ({fields}), but plan does not know how "
            f"that family lays out its experts, shared experts and routers; it knows {', '.join(MOE_MODEL_TYPES)}"
        )
    per_token_field = "num_experts_per_tok" if config.get("num_experts_per_tok") is not None else "experts_per_token"
    per_token = _field(config, name, per_token_field)
    if per_token is None:
        raise ValueError(f"config {name!r}: a MoE config needs 'num_experts_per_tok' (experts per token)")
    if per_token > count:
        raise ValueError(
            f"config {name!r}: field {per_token_field!r} ({per_token}) exceeds the routed experts "
            f"({count_field}={count}): a token cannot go to more experts than there are"
        )
    layers = _field(config, name, "num_hidden_layers")
    if model_type in ("mixtral", "gpt_oss"):
        width = _field(config, name, "intermediate_size")
        if width is None:
            raise ValueError(f"config {name!r}: a {model_type} config needs 'intermediate_size' (its experts' width)")
        routed = tuple(range(layers))
        return Experts(
            count, per_token, width, routed, bias=model_type == "gpt_oss", router_bias=model_type == "gpt_oss"
        )
    width = _field(config, name, "moe_intermediate_size")
    if width is None:
        raise ValueError(f"config {name!r}: a {model_type} config needs 'moe_intermediate_size'")
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", *ALL_ROUTED_MODEL_TYPES):
        shared = _field(config, name, "shared_expert_intermediate_size", default=0, minimum=0)
        if model_type in ALL_ROUTED_MODEL_TYPES:
            routed = tuple(range(layers))
        else:
            step = _field(config, name, "decoder_sparse_step", default=1)
            dense = _layer_indices(config, name, "mlp_only_layers", layers)
            routed = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if model_type == "qwen3_moe":
            shared = 0
        return Experts(count, per_token, width, routed, shared_intermediate=shared, shared_gate=bool(shared))
    # deepseek_v3, glm4_moe: the first layers dense, then routed experts beside shared ones of the same width; the
    # router picks experts within its best groups (``n_group`` groups of ``count / n_group``, ``topk_group`` kept).
    first_dense = _field(config, name, "first_k_dense_replace", default=0, minimum=0)
    if first_dense > layers:
        raise ValueError(
            f"config {name!r}: field 'first_k_dense_replace' ({first_dense}) exceeds num_hidden_layers ({layers})"
        )
    groups = _field(config, name, "n_group", default=1)
    kept = _field(config, name, "topk_group", default=groups)
    if count % groups:
        raise ValueError(f"config {name!r}: field 'n_group' ({groups}) must divide {count_field} ({count})")
    if kept > groups:
        raise ValueError(f"config {name!r}: field 'topk_group' ({kept}) exceeds 'n_group' ({groups})")
    if per_token > kept * (count // groups):
        raise ValueError(
            f"config {name!r}: field {per_token_field!r} ({per_token}) exceeds the experts of the {kept} groups "
            f"the router keeps ('topk_group' x {count_field} / 'n_group' = {kept * (count // groups)})"
        )
    shared = _field(config, name, "n_shared_experts", default=0, minimum=0) * width
    return Experts(count, per_token, width, tuple(range(first_dense, layers)), shared_intermediate=shared)


def dims_from_config(config: dict, *, name: str = "config") -> ModelDims:
    """:class:`ModelDims` from a transformers config dict (a multimodal config's ``text_config`` is used).

    Mixture-of-experts configs of the families in :data:`MOE_MODEL_TYPES` count every expert; other configs with
    expert counts, and configs with layers other than softmax attention, are refused by name. ``intermediate_size``
    is read where some layer has a dense MLP (a family whose every layer is routed, Qwen3.5-MoE, has none).

    Raises:
        ValueError: naming the fields the config lacks or holds malformed values in (non-positive or non-integer
            sizes, a layer pattern that is not one kind per layer, more experts per token than experts).
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a config.json path or a preset name, got {type(config).__name__}")
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    missing = [field for field in REQUIRED_FIELDS if config.get(field) is None]
    if missing:
        raise ValueError(f"config {name!r} lacks {', '.join(missing)}: plan needs {', '.join(REQUIRED_FIELDS)}")
    _refuse_unmodelled_layers(config, name)
    hidden = _field(config, name, "hidden_size")
    layers = _field(config, name, "num_hidden_layers")
    heads = _field(config, name, "num_attention_heads")
    kv_heads = _field(config, name, "num_key_value_heads", default=heads)
    head_dim = _field(config, name, "head_dim") or hidden // heads
    if not head_dim:
        raise ValueError(f"config {name!r}: hidden_size {hidden} < num_attention_heads {heads} and no 'head_dim'")
    model_type = config.get("model_type")
    latent = None
    if config.get("kv_lora_rank") is not None:  # multi-head latent attention: key heads are nope + rope
        rope = _field(config, name, "qk_rope_head_dim", default=0, minimum=0)
        head_dim = _field(config, name, "qk_nope_head_dim") + rope
        latent = LatentAttention(
            _field(config, name, "q_lora_rank", default=0, minimum=0), _field(config, name, "kv_lora_rank"), rope
        )
    v_head_dim = _field(config, name, "v_head_dim") or head_dim
    qkv_bias = bool(config.get("attention_bias", config.get("qkv_bias", model_type in ("qwen2", "qwen2_moe"))))
    extra = 0
    qk_norm_types = ("qwen3", "qwen3_moe", "gemma3_text", *LINEAR_ATTENTION_MODEL_TYPES)
    if model_type in qk_norm_types or (model_type == "glm4_moe" and config.get("use_qk_norm")):
        extra += 2 * head_dim  # a norm over each query and each key head
    elif model_type == "olmo2":
        extra += (heads + kv_heads) * head_dim  # norms over the whole query and key projections
    elif model_type == "cohere" and config.get("use_qk_norm"):
        extra += (heads + kv_heads) * head_dim  # a norm per head
    if model_type == "gpt_oss":
        extra += hidden + heads  # the output projection's bias and one sink per head
    elif model_type in ("llama", "granite") and qkv_bias:
        extra += hidden  # attention_bias covers the output projection too
    # transformers drops the window of a config that turns it off (Qwen2's use_sliding_window=False); 0 is none.
    window = _field(config, name, "sliding_window", minimum=0) if config.get("use_sliding_window", True) else None
    experts = experts_from_config(config, name)
    dense_layers = layers - (0 if experts is None else len(experts.layers))
    intermediate = _field(config, name, "intermediate_size")
    if intermediate is None:
        if dense_layers:
            raise ValueError(
                f"config {name!r} lacks intermediate_size: {dense_layers} of its {layers} layers have a dense MLP "
                "of that width"
            )
        intermediate = 0  # every layer routed: no dense MLP
    dims = ModelDims(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        intermediate=intermediate,
        vocab=_field(config, name, "vocab_size"),
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        sliding_window=window or None,
        name=name,
        norms_per_layer=NORMS_PER_LAYER.get(model_type, 2),
        attention_extra=extra,
        experts=experts,
        latent=latent,
        linear=linear_from_config(config, name),
        attention_gate=model_type in LINEAR_ATTENTION_MODEL_TYPES and bool(config.get("attn_output_gate", True)),
    )
    return dims


#: Configs ``plan`` knows beyond the bench presets: models too large to build for a benchmark here.
PLAN_CONFIGS = {
    "qwen2.5-72b": {
        "model_type": "qwen2",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 29568,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}


def dims_from_preset(name: str) -> ModelDims:
    """:class:`ModelDims` of a bench preset (``shared_prefix_logps.bench.presets``) or of :data:`PLAN_CONFIGS`."""
    from ..bench.presets import PRESETS

    if name in PLAN_CONFIGS:
        return dims_from_config(PLAN_CONFIGS[name], name=name)
    if name not in PRESETS:
        known = ", ".join([*PRESETS, *PLAN_CONFIGS])
        raise ValueError(f"unknown preset {name!r}; choose from {known} or pass a config.json path")
    p = PRESETS[name]
    config = {
        "model_type": p.family,
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "vocab_size": p.vocab,
        "tie_word_embeddings": p.tied,
        **dict(p.extra),
    }
    if p.mlp is not None:  # None: every layer routed, no dense MLP width
        config["intermediate_size"] = p.mlp
    return dims_from_config(config, name=name)


def load_dims(model: str | Path | dict | ModelDims) -> ModelDims:
    """:class:`ModelDims` from a preset name, a ``config.json`` path (or a directory holding one) or a config dict.

    Raises:
        ValueError: an unknown preset, a file that is not a JSON config, a config without the needed fields.
    """
    if isinstance(model, ModelDims):
        return model
    if isinstance(model, dict):
        return dims_from_config(model)
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a preset name, a config.json path or a dict, got {type(model).__name__}")
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"model {str(model)!r} is not a readable JSON config: {error}") from error
        return dims_from_config(config, name=str(model))
    return dims_from_preset(str(model))

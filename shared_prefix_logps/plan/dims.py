"""The sizes of a decoder-only model that its memory and FLOPs depend on, from a config or a bench preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

#: Config fields every prediction needs (``head_dim``, ``num_key_value_heads`` and ``tie_word_embeddings`` have
#: defaults, as in transformers).
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)

#: Config fields that count routed experts, in the families' own names; a config with one of them set above zero is
#: a mixture-of-experts model.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")

#: Mixture-of-experts families whose layout :func:`experts_from_config` knows: which layers route, the experts'
#: width, shared experts and routers. Configs with expert counts of any other type are refused by name.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")

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
class ModelDims:
    """Sizes of a Llama/Qwen-style decoder (gated MLP, RMSNorm, grouped-query or latent attention), dense or with
    routed experts.

    Attributes:
        hidden, layers, heads, kv_heads, head_dim, v_head_dim, intermediate, vocab: the config's sizes
            (``intermediate``: the dense layers' MLP width).
        tied: whether the LM head shares the embedding's weight.
        qkv_bias: whether q/k/v projections have a bias (Qwen2).
        sliding_window: the config's sliding window (None: none); a window shorter than the keys makes ``expand``
            build masks even for unpadded prompts.
        name: where the sizes came from (a preset name or a path), for reports.
        norms_per_layer: RMSNorms of a decoder layer (their H weights each).
        attention_extra: other parameters of one attention block: q/k norms, an output bias, attention sinks.
        experts: the routed experts (None: a dense model).
        latent: multi-head latent attention's ranks (None: q/k/v projections of their heads).
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
        q = self.heads * self.head_dim
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
        return self.attention_params + mlp + self.norms_per_layer * self.hidden

    @property
    def params(self) -> int:
        """All parameters: embedding, layers (every expert of every MoE layer), final norm and (untied) LM head."""
        embedding = self.vocab * self.hidden
        per_layer = self.attention_params + self.norms_per_layer * self.hidden
        mlp = (self.layers - self.moe_layers) * self.dense_mlp_params
        if self.experts is not None:
            mlp += self.moe_layers * self.experts.mlp_params(self.hidden)
        return embedding * (1 if self.tied else 2) + self.layers * per_layer + mlp + self.hidden

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
        experts = self.experts
        if experts is not None:
            experts = replace(experts, layers=tuple(i for i in experts.layers if i < layers))
        return replace(self, layers=layers, experts=experts)


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


def _refuse_unmodelled_layers(config: dict, name: str) -> None:
    """Layers that are not softmax attention (linear attention, state-space mixers) are refused by name: the plan's
    terms are those of attention layers, and the library refuses such models."""
    kinds = config.get("layer_types")
    if isinstance(kinds, (list, tuple)):
        other = sorted({str(kind) for kind in kinds} - {"full_attention", "sliding_attention", "chunked_attention"})
        if other:
            raise ValueError(
                f"config {name!r} (model type {config.get('model_type')!r}) has {', '.join(other)} layers; plan models "
                "softmax-attention decoders only (and the library refuses such models)"
            )


def experts_from_config(config: dict, name: str) -> Experts | None:
    """:class:`Experts` of a mixture-of-experts config (None for a dense one), laid out as its family lays them out
    in transformers.

    Raises:
        ValueError: a config with expert counts of a family not in :data:`MOE_MODEL_TYPES` (not planned as dense),
            or an expert field that is not a positive integer, named.
    """
    counts = {field: _field(config, name, field, minimum=0) for field in EXPERT_COUNT_FIELDS}
    count = next((value for value in counts.values() if value), 0)
    model_type = config.get("model_type")
    if not count:
        return None
    if model_type not in MOE_MODEL_TYPES:
        fields = ", ".join(f"{field}={value}" for field, value in counts.items() if value)
        raise ValueError(
            f"config {name!r}: model type {model_type!r} has routed experts ({fields}), but plan does not know how "
            f"that family lays out its experts, shared experts and routers; it knows {', '.join(MOE_MODEL_TYPES)}"
        )
    per_token = _field(config, name, "num_experts_per_tok") or _field(config, name, "experts_per_token")
    if per_token is None:
        raise ValueError(f"config {name!r}: a MoE config needs 'num_experts_per_tok' (experts per token)")
    layers = _field(config, name, "num_hidden_layers")
    if model_type in ("mixtral", "gpt_oss"):
        width = _field(config, name, "intermediate_size")
        routed = tuple(range(layers))
        return Experts(
            count, per_token, width, routed, bias=model_type == "gpt_oss", router_bias=model_type == "gpt_oss"
        )
    width = _field(config, name, "moe_intermediate_size")
    if width is None:
        raise ValueError(f"config {name!r}: a {model_type} config needs 'moe_intermediate_size'")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = _field(config, name, "decoder_sparse_step", default=1)
        dense = set(config.get("mlp_only_layers") or ())
        routed = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        shared = _field(config, name, "shared_expert_intermediate_size", default=0, minimum=0)
        if model_type == "qwen3_moe":
            shared = 0
        return Experts(count, per_token, width, routed, shared_intermediate=shared, shared_gate=bool(shared))
    # deepseek_v3, glm4_moe: the first layers dense, then routed experts beside shared ones of the same width.
    first_dense = _field(config, name, "first_k_dense_replace", default=0, minimum=0)
    shared = _field(config, name, "n_shared_experts", default=0, minimum=0) * width
    return Experts(count, per_token, width, tuple(range(first_dense, layers)), shared_intermediate=shared)


def dims_from_config(config: dict, *, name: str = "config") -> ModelDims:
    """:class:`ModelDims` from a transformers config dict (a multimodal config's ``text_config`` is used).

    Mixture-of-experts configs of the families in :data:`MOE_MODEL_TYPES` count every expert; other configs with
    expert counts, and configs with layers other than softmax attention, are refused by name.

    Raises:
        ValueError: naming the fields the config lacks or holds non-positive or non-integer values in.
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
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text") or (model_type == "glm4_moe" and config.get("use_qk_norm")):
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
    dims = ModelDims(
        hidden=hidden,
        layers=_field(config, name, "num_hidden_layers"),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        intermediate=_field(config, name, "intermediate_size"),
        vocab=_field(config, name, "vocab_size"),
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        sliding_window=window or None,
        name=name,
        norms_per_layer=NORMS_PER_LAYER.get(model_type, 2),
        attention_extra=extra,
        experts=experts_from_config(config, name),
        latent=latent,
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
        "intermediate_size": p.mlp,
        "vocab_size": p.vocab,
        "tie_word_embeddings": p.tied,
        **dict(p.extra),
    }
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

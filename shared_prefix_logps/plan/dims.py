"""The sizes of a decoder-only model that its memory and FLOPs depend on, from a config or a bench preset."""

from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a Llama/Qwen-style decoder (gated MLP, RMSNorm, grouped-query attention).

    Attributes:
        hidden, layers, heads, kv_heads, head_dim, v_head_dim, intermediate, vocab: the config's sizes.
        tied: whether the LM head shares the embedding's weight.
        qkv_bias: whether q/k/v projections have a bias (Qwen2).
        sliding_window: the config's sliding window (None: none); a window shorter than the keys makes ``expand``
            build masks even for unpadded prompts.
        name: where the sizes came from (a preset name or a path), for reports.
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

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v/o projections, gated MLP, two norms."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * (self.head_dim + self.v_head_dim)
        attention = self.hidden * (q + kv) + self.heads * self.v_head_dim * self.hidden
        if self.qkv_bias:
            attention += q + kv
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """All parameters: embedding, layers, final norm and (untied) LM head."""
        embedding = self.vocab * self.hidden
        return embedding * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    def windowed(self, keys: int) -> bool:
        """Whether the sliding window hides some of ``keys`` keys from a query (``AttentionShape.windowed``)."""
        return self.sliding_window is not None and self.sliding_window < keys

    def with_layers(self, layers: int | None) -> ModelDims:
        """The same model with ``layers`` decoder layers (None: unchanged), as ``bench --layers`` builds it."""
        if layers is None:
            return self
        _positive("layers", layers)
        return ModelDims(**{**self.__dict__, "layers": layers})


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def dims_from_config(config: dict, *, name: str = "config") -> ModelDims:
    """:class:`ModelDims` from a transformers config dict (a multimodal config's ``text_config`` is used).

    Raises:
        ValueError: naming the fields the config lacks or holds non-positive values in.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a config.json path or a preset name, got {type(config).__name__}")
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    missing = [field for field in REQUIRED_FIELDS if config.get(field) is None]
    if missing:
        raise ValueError(f"config {name!r} lacks {', '.join(missing)}: plan needs {', '.join(REQUIRED_FIELDS)}")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if config.get("qk_nope_head_dim") is not None:  # multi-head latent attention: key heads are nope + rope
        head_dim = config["qk_nope_head_dim"] + config.get("qk_rope_head_dim", 0)
    dims = ModelDims(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        v_head_dim=config.get("v_head_dim") or head_dim,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        # transformers drops the window of a config that turns it off (Qwen2's use_sliding_window=False).
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
        name=name,
    )
    for field, value in dims.__dict__.items():
        if isinstance(value, int) and not isinstance(value, bool):
            _positive(f"config field for {field!r}", value)
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
    return ModelDims(
        hidden=p.hidden,
        layers=p.layers,
        heads=p.heads,
        kv_heads=p.kv_heads,
        head_dim=p.head_dim,
        v_head_dim=p.head_dim,
        intermediate=p.mlp,
        vocab=p.vocab,
        tied=p.tied,
        qkv_bias=p.family == "qwen2",
        sliding_window=dict(p.extra).get("sliding_window"),
        name=name,
    )


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

"""Everything the library does to a model before and outside its forward: ``discovery`` (the causal LM inside its
wrappers, supported families, head settings, RoPE limits), ``installation`` (the attention registry entries and mask
builders, non-reentrant checkpointing), ``head_check`` (the fused head reproduces the model's logits),
``compiled`` (``torch.compile``d models) and ``preparation`` (all of it, once per model). What then runs inside the
forward is in ``forward/``.
"""

from ..errors import UnsupportedModelError
from .discovery import SUPPORTED_MODEL_TYPES, HeadSpec, unwrap_causal_lm
from .preparation import PreparedModel, prepare_model

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HeadSpec",
    "PreparedModel",
    "UnsupportedModelError",
    "prepare_model",
    "unwrap_causal_lm",
]

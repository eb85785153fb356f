"""The activation terms at 7B scale: a Qwen2.5-7B-sized model traced under FakeTensorMode (no memory allocated)."""

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from shared_prefix_logps.plan.dims import dims_from_preset
from shared_prefix_logps.plan.memory import final_norm_bytes_per_token, layer_bytes_per_token

TOKENS = 1024


def _saved_bytes(dims, layers: int) -> int:
    """Bytes the decoder (no head) saves for backward over TOKENS bf16 tokens, parameters excluded."""
    config = transformers.Qwen2Config(
        hidden_size=dims.hidden,
        num_hidden_layers=layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        intermediate_size=dims.intermediate,
        vocab_size=dims.vocab,
        tie_word_embeddings=dims.tied,
    )
    config._attn_implementation = "sdpa"
    saved = {}

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        saved[id(base)] = base.untyped_storage().nbytes()
        return tensor

    default = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = transformers.Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        parameters = {id(p) for p in model.parameters()}
        ids = torch.randint(0, dims.vocab, (1, TOKENS))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.model(input_ids=ids)
    return sum(nbytes for key, nbytes in saved.items() if key not in parameters)


def test_saved_activations_per_layer_and_final_norm_at_7b_widths():
    dims = dims_from_preset("qwen2.5-7b")
    one, two = _saved_bytes(dims, 1), _saved_bytes(dims, 2)
    per_layer = (two - one) / TOKENS
    assert abs(per_layer / layer_bytes_per_token(dims, 2) - 1) < 0.01, (per_layer, layer_bytes_per_token(dims, 2))
    # The rest is the final norm (the embedding's bf16 output is saved by nothing: the first norm upcasts it), less
    # the norm's output, which the head saves and this trace has no head for.
    rest = one / TOKENS - per_layer
    expected = final_norm_bytes_per_token(dims, 2) - dims.hidden * 2
    assert abs(rest / expected - 1) < 0.03, (rest, expected)

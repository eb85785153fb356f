"""Dropout active (a model in training mode with attention dropout, a dropout module or MoE router jitter): every entry
point runs and warns with ``SharedDropoutWarning`` that a prefix's draw is shared by the rows that continue it; in
eval mode, with the dropout at 0, or with ``backend="dense"`` (which draws per row) nothing is warned. The trainer
plug-ins read the same detection (``integrations/common/modules.py``).

The warning states a fact the tests check too: with attention dropout in the prompt's forward only, the completions
of one prompt see one draw (two identical completions get identical log-probs), where the dense rows see one each.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import (
    SharedDropoutWarning,
    chunked_backward,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.integrations.common.modules import dropout_active
from shared_prefix_logps.model.dropout import dropout_source


def _with_attention_dropout(model, rate: float):
    model.config.attention_dropout = rate
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = rate
    return model


def _calls(backend: str = "expand"):
    """Each entry point's call on one batch (2 prompts, 2 completions each)."""
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3, seed=1)
    rows = torch.cat([prompts.repeat_interleave(2, 0), comps], dim=1)
    mask = torch.cat([pmask.repeat_interleave(2, 0), cmask], dim=1)
    score = torch.cat([torch.zeros_like(pmask.repeat_interleave(2, 0)), cmask], dim=1)

    def loss(out, rows):
        return out.logps.sum()

    grouped = dict(prompt_mask=pmask, completion_mask=cmask, backend=backend)
    calls = {
        "compute_logps": lambda m: compute_logps(m, prompts, comps, **grouped),
        "compute_logps_concatenated": lambda m: compute_logps_concatenated(m, rows, mask, 3, backend=backend),
        "compute_logps_tree": lambda m: compute_logps_tree(m, rows, mask, score, backend=backend),
    }
    if backend != "dense":
        calls["chunked_backward"] = lambda m: chunked_backward(
            m, prompts, comps, loss, generations_per_chunk=1, **grouped
        )
        calls["chunked_backward_tree"] = lambda m: chunked_backward_tree(m, rows, mask, score, loss, backend=backend)
    return calls


def _dropout_phi3():
    """Phi-3 with residual dropout modules (``resid_pdrop``), attention dropout 0."""
    model = build_model("phi3")
    model.config.resid_pdrop = 0.1
    for layer in model.model.layers:
        layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = 0.1
    return model


def _jitter_mixtral():
    model = build_model("mixtral")
    for module in model.modules():
        if hasattr(module, "jitter_noise"):
            module.jitter_noise = 0.05
    return model


MODELS = {
    "attention dropout": (lambda: _with_attention_dropout(build_model("llama"), 0.1), "attention_dropout=0.1"),
    "dropout module": (_dropout_phi3, "Dropout at model.layers.0.resid_attn_dropout with p=0.1"),
    "router jitter": (_jitter_mixtral, "router jitter_noise=0.05"),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_entry_point_warns_that_the_prefix_dropout_is_shared(kind):
    build, source = MODELS[kind]
    model = build().train()
    for name, call in _calls().items():
        with pytest.warns(SharedDropoutWarning) as caught:
            call(model)
        (warning,) = [w for w in caught if w.category is SharedDropoutWarning]
        message = str(warning.message)
        assert message.startswith(f"{name}: dropout is active"), message
        assert source in message, message
        assert "shared by every row that continues it (a prompt's by its G completions)" in message, message
        assert warning.filename == __file__  # points at the caller's line, not into the package


@pytest.mark.parametrize("kind", list(MODELS))
def test_no_warning_in_eval_mode(kind):
    model = MODELS[kind][0]().eval()
    assert not dropout_active(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDropoutWarning)
        for call in _calls().values():
            call(model)


def test_no_warning_without_dropout_or_with_the_dense_path():
    model = build_model("llama").train()  # training mode, every dropout rate 0
    assert dropout_source(model) is None
    dropped = _with_attention_dropout(build_model("llama"), 0.1).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDropoutWarning)
        for call in _calls().values():
            call(model)
        for call in _calls("dense").values():  # full rows draw per row
            call(dropped)


def test_the_prompts_attention_dropout_is_drawn_once_for_its_completions():
    """Attention dropout confined to the prompt (one layer, completions of one token): two identical completions of
    one prompt get identical log-probs on the shared path (one draw), different ones as dense rows (a draw each)."""
    model = _with_attention_dropout(build_model("llama", layers=1), 0.5).train()
    prompts = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    completions = torch.tensor([[13], [13]])  # the prompt's last token predicts both: its attention is the prompt's
    torch.manual_seed(0)
    with pytest.warns(SharedDropoutWarning), torch.no_grad():
        shared = compute_logps(model, prompts, completions).logps
    torch.manual_seed(0)
    with torch.no_grad():
        dense = compute_logps(model, prompts, completions, backend="dense").logps
    assert torch.equal(shared[0], shared[1])
    assert not torch.equal(dense[0], dense[1])

"""The family verdicts (shared_prefix_logps.recurrent.families) against the installed transformers: every family whose
layers keep a recurrent state has one, the layers they name exist, the families said to continue from a given state
do so through this package at the layer level, and the reasons given for the others hold."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
import torch
import transformers
from packaging.version import Version
from support.hybrid_families import tiny_family_model
from support.hybrid_models import HYBRID_FAMILIES, build_hybrid
from support.hybrid_models import recurrent_layers as gdn_layers
from support.tiny_models import build_model
from transformers import CONFIG_MAPPING

from shared_prefix_logps import UnsupportedModelError
from shared_prefix_logps.recurrent import NodeSpans, RecurrentState, run_from_states
from shared_prefix_logps.recurrent.families import (
    MIN_TRANSFORMERS,
    VERDICTS,
    check_served,
    family_verdict,
    recurrent_layers,
)

# The state cache speaks the linear-attention cache layer of transformers >= 5.15 (see families.MIN_TRANSFORMERS).
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < MIN_TRANSFORMERS, reason=f"needs transformers >= {MIN_TRANSFORMERS}"
)

#: Source markers of a layer that keeps a state between forwards (the linear-attention cache calls, MiniMax's linear
#: cache, RecurrentGemma's module-held window, RWKV's kernel).
_STATE_MARKERS = (
    "update_conv_state(",
    "update_recurrent_state(",
    "get_linear_cache(",
    "conv1d_state",
    "def rwkv_linear_attention",
)


def _recurrent_packages() -> dict[str, list[str]]:
    """transformers model package -> the model types its config file declares, for every package whose modeling
    code keeps a recurrent state."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = {}
    for package in sorted(root.iterdir()):
        modeling = package / f"modeling_{package.name}.py"
        if modeling.exists() and any(marker in modeling.read_text() for marker in _STATE_MARKERS):
            config = package / f"configuration_{package.name}.py"
            found[package.name] = re.findall(r'model_type = "([a-z0-9_]+)"', config.read_text())
    return found


def test_every_family_with_recurrent_layers_has_a_verdict():
    packages = _recurrent_packages()
    assert "qwen3_next" in packages and "mamba" in packages  # the scan sees the families it is about
    missing = [name for name, types in packages.items() if not any(t in VERDICTS for t in types)]
    assert not missing, f"recurrent families without a verdict: {missing}"


@pytest.mark.parametrize("model_type", sorted(VERDICTS))
def test_the_layers_a_verdict_names_exist(model_type):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    package = CONFIG_MAPPING[model_type].__module__.split(".")[2]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    for name in VERDICTS[model_type].layers:
        assert hasattr(modeling, name), f"{model_type}: no {name} in {modeling.__name__}"


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_served_families_resolve_their_recurrent_layers(family):
    model = build_hybrid(family)
    verdict = check_served(model)
    assert verdict is not None and verdict.served and verdict.continues
    assert recurrent_layers(model, verdict) == gdn_layers(model)


def test_a_plain_attention_family_has_no_verdict():
    assert check_served(build_model("llama")) is None


def test_a_vision_language_config_is_judged_by_its_language_model():
    config = transformers.Qwen3_5Config(text_config={"num_hidden_layers": 1})
    assert family_verdict(config)[0] in ("qwen3_5", "qwen3_5_text")
    config = transformers.Lfm2VlConfig(text_config={"model_type": "lfm2", "num_hidden_layers": 1})
    assert family_verdict(config) == ("lfm2", VERDICTS["lfm2"])


@pytest.mark.parametrize("model_type", ["nemotron_h", "lfm2", "mamba", "kimi_linear", "recurrent_gemma"])
def test_unserved_families_are_refused_by_name_with_the_reason(model_type):
    model = tiny_family_model(model_type)
    with pytest.raises(UnsupportedModelError) as refusal:
        check_served(model)
    message = str(refusal.value)
    assert repr(model_type) in message
    assert VERDICTS[model_type].how in message


def _split_against_full(mixer, hidden_size: int, cut: int, length: int = 40):
    """(max |output diff|, max relative gradient error) of the layer run as [0, cut) then [cut, length) from the
    first part's end state, against its own forward over the whole rows."""
    torch.manual_seed(1)
    hidden = torch.randn(2, length, hidden_size, requires_grad=True)
    weight = torch.randn(2, length, hidden_size)
    reference = mixer(hidden)
    rows = torch.arange(2)
    first, end = run_from_states(
        mixer, hidden, NodeSpans(rows, torch.zeros(2, dtype=torch.long), torch.full((2,), cut))
    )
    second, _ = run_from_states(
        mixer, hidden, NodeSpans(rows, torch.full((2,), cut), torch.full((2,), length - cut)), end
    )
    joined = torch.cat([first[:, :cut], second[:, cut:]], 1)
    leaves = [hidden, *mixer.parameters()]
    got = torch.autograd.grad((joined * weight).sum(), leaves, allow_unused=True)
    expected = torch.autograd.grad((reference * weight).sum(), leaves, allow_unused=True)
    grad_error = max(
        ((g - e).norm() / e.norm()).item() for g, e in zip(got, expected) if g is not None and e.norm() > 0
    )
    return (joined - reference).abs().max().item(), grad_error


#: One family per mechanism said to continue (Gated DeltaNet, Kimi delta attention, Mamba2 mixers, short
#: convolutions), beyond the served ones.
CONTINUING = ["olmo_hybrid", "kimi_linear", "nemotron_h", "granitemoehybrid", "falcon_h1", "bamba", "lfm2", "lfm2_moe"]


@pytest.mark.parametrize("model_type", CONTINUING)
def test_families_said_to_continue_do_so_through_this_package(model_type):
    assert VERDICTS[model_type].continues
    model = tiny_family_model(model_type)
    mixer = recurrent_layers(model, VERDICTS[model_type])[0]
    # A one-token prefix, inside the Mamba2 chunk (16), multi-token suffixes; a one-token suffix where the verdict
    # says the decode path back-propagates.
    cuts = (1, 17, 30, 39) if VERDICTS[model_type].one_token else (1, 17, 30)
    for cut in cuts:
        output_error, grad_error = _split_against_full(mixer, model.config.hidden_size, cut)
        assert output_error < 1e-5, (cut, output_error)
        assert grad_error < 1e-4, (cut, grad_error)


def test_mamba2_one_token_segments_from_a_state_cannot_back_propagate():
    """The reason given for Mamba2's one-token nodes: without gradients the decode path continues exactly, with
    them its in-place state update breaks backward."""
    verdict = VERDICTS["nemotron_h"]
    assert not verdict.one_token
    model = tiny_family_model("nemotron_h")
    mixer = recurrent_layers(model, verdict)[0]
    hidden = torch.randn(1, 8, model.config.hidden_size)
    with torch.no_grad():
        full = mixer(hidden)
        _, end = run_from_states(mixer, hidden, NodeSpans.packed(torch.tensor([7])))
        last, _ = run_from_states(mixer, hidden[:, 7:], NodeSpans.packed(torch.tensor([1])), end)
    assert (last[0, 0] - full[0, 7]).abs().max().item() < 1e-5
    _, end = run_from_states(mixer, hidden, NodeSpans.packed(torch.tensor([7])))
    last, _ = run_from_states(mixer, hidden[:, 7:], NodeSpans.packed(torch.tensor([1])), end)
    with pytest.raises(RuntimeError, match="inplace"):
        last.sum().backward()


def test_mamba2_one_token_leaves_back_propagate_in_a_call_of_leaves():
    """What the engine does about it for leaves: with ``keep_ends=False`` a one-token node runs as two copies of its
    token through the chunked scan, and its output and gradients are the full row's."""
    model = tiny_family_model("nemotron_h")
    mixer = recurrent_layers(model, VERDICTS["nemotron_h"])[0]
    torch.manual_seed(3)
    hidden = torch.randn(1, 8, model.config.hidden_size, requires_grad=True)
    children = torch.randn(3, 1, model.config.hidden_size, requires_grad=True)
    weight = torch.randn(3, model.config.hidden_size)
    _, end = run_from_states(mixer, hidden, NodeSpans.packed(torch.tensor([8])))
    spans = NodeSpans.from_mask(torch.ones(3, 1, dtype=torch.bool))
    out, none = run_from_states(mixer, children, spans, end.select(torch.zeros(3, dtype=torch.long)), keep_ends=False)
    assert none is None
    rows = torch.cat([hidden.expand(3, -1, -1), children], 1)
    reference = mixer(rows)[:, 8]
    assert (out[:, 0] - reference).abs().max().item() < 1e-5
    leaves = [hidden, children, *mixer.parameters()]
    got = torch.autograd.grad((out[:, 0] * weight).sum(), leaves)
    expected = torch.autograd.grad((reference * weight).sum(), leaves)
    assert max(((g - e).norm() / e.norm()).item() for g, e in zip(got, expected) if e.norm() > 0) < 1e-4


@pytest.mark.parametrize(
    "model_type", ["mamba", "falcon_mamba", "jamba", "zamba", "nemotron_h", "olmo_hybrid", "qwen3_next"]
)
def test_whether_a_multi_token_segment_reads_the_recurrence_state(model_type):
    """The reason given for the Mamba-1 families: a multi-token segment does not read the recurrence state (its
    scan takes none), so replacing it by noise changes nothing; the families said to continue read it."""
    verdict = VERDICTS[model_type]
    model = tiny_family_model(model_type)
    mixer = recurrent_layers(model, verdict)[0]
    torch.manual_seed(2)
    hidden = torch.randn(1, 30, model.config.hidden_size)
    with torch.no_grad():
        _, end = run_from_states(mixer, hidden[:, :20], NodeSpans.packed(torch.tensor([20])))
        noise = RecurrentState(
            conv=end.conv, recurrence={i: 10 * torch.randn_like(t) for i, t in end.recurrence.items()}
        )
        spans = NodeSpans.packed(torch.tensor([10]))
        continued, _ = run_from_states(mixer, hidden[:, 20:], spans, end)
        from_noise, _ = run_from_states(mixer, hidden[:, 20:], spans, noise)
    assert end.recurrence  # the layer does store a recurrence state
    reads_state = not torch.equal(continued, from_noise)
    assert reads_state == verdict.continues


def test_recurrent_gemma_restarts_its_convolution_in_a_multi_token_forward():
    model = tiny_family_model("recurrent_gemma")
    ids = torch.randint(3, 101, (2, 40))
    with torch.no_grad():
        full = model(ids, use_cache=True).logits
        first = model(ids[:, :20], use_cache=True, position_ids=torch.arange(20)[None].expand(2, -1)).logits
        second = model(ids[:, 20:], use_cache=True, position_ids=torch.arange(20, 40)[None].expand(2, -1)).logits
    assert (torch.cat([first, second], 1) - full).abs().max().item() > 1e-2

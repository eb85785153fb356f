"""OpenRLHF actors and batches for the OpenRLHF plug-in's tests.

OpenRLHF imports ``flash_attn`` at module level (``openrlhf.models.ring_attn_utils``) but uses it only for
``packing_samples`` and ring attention, which need CUDA. flash-attn builds only against CUDA, so on a CPU machine
:func:`import_openrlhf` registers a stand-in module whose functions raise if called: every path the tests run
(unpacked rows) never calls them, and a test that reached one would fail loudly. The same holds for vLLM, which
``openrlhf.trainer.ray`` imports for its generation engines (:func:`import_ppo_actor`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import torch

from .tiny_models import VOCAB, build_model


def _flash_attn_stand_in() -> None:
    def unavailable(*args, **kwargs):
        raise RuntimeError("flash-attn is not installed: OpenRLHF's packing and ring-attention paths are unavailable")

    package = types.ModuleType("flash_attn")
    package.__path__ = []
    # no distribution behind it: transformers' availability check (find_spec, then the package's version) says no
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    bert_padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
        setattr(bert_padding, name, unavailable)
    utils = types.ModuleType("flash_attn.utils")
    utils.__path__ = []
    distributed = types.ModuleType("flash_attn.utils.distributed")
    distributed.all_gather = unavailable
    sys.modules.update(
        {
            "flash_attn": package,
            "flash_attn.bert_padding": bert_padding,
            "flash_attn.utils": utils,
            "flash_attn.utils.distributed": distributed,
        }
    )


def _vllm_stand_in() -> None:
    def unavailable(*args, **kwargs):
        raise RuntimeError("vLLM is not installed: OpenRLHF's generation engines are unavailable")

    package = types.ModuleType("vllm")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    package.__version__ = "0"
    package.SamplingParams = unavailable
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = unavailable
    utils = types.ModuleType("vllm.utils")
    utils.random_uuid = unavailable
    sys.modules.update({"vllm": package, "vllm.inputs": inputs, "vllm.utils": utils})


def import_ppo_actor():
    """``openrlhf.trainer.ray.ppo_actor`` (its package imports vLLM, used only by generation engines: a stand-in
    whose functions raise where vLLM is missing)."""
    import_openrlhf()
    try:
        importlib.import_module("vllm")
    except ImportError:
        _vllm_stand_in()
    return importlib.import_module("openrlhf.trainer.ray.ppo_actor")


def import_openrlhf():
    """``openrlhf.models`` (with the flash-attn stand-in where flash-attn is missing)."""
    try:
        importlib.import_module("flash_attn.bert_padding")
    except ImportError:
        _flash_attn_stand_in()
    return importlib.import_module("openrlhf.models")


def make_actor(*, family: str = "llama", seed: int = 0, temperature: float = 1.0, lora: bool = False, model=None):
    """An ``openrlhf.models.Actor`` around a tiny float32 model (OpenRLHF loads float32 models only from objects).

    ``lora``: the model wrapped as OpenRLHF's ``Actor`` wraps it with ``lora_rank > 0`` (PEFT LoRA on every linear
    layer), adapters randomized so that they change the numbers."""
    models = import_openrlhf()
    if model is None:
        model = build_model(family, seed=seed)
    if lora:
        from peft import LoraConfig, TaskType, get_peft_model

        from .tiny_models import randomize_lora

        torch.manual_seed(seed)
        config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules="all-linear", bias="none")
        model = randomize_lora(get_peft_model(model, config))
    actor = models.Actor(model, temperature=temperature)
    actor.packing_samples = False  # Actor sets it only when it loads the model from a path
    return actor


def openrlhf_rows(
    num_prompts: int,
    generations: int,
    *,
    seed: int = 0,
    left_pad: bool = False,
    multi_turn=False,
    system_prompt: int = 0,
):
    """A batch as OpenRLHF >= 0.10 builds it: each row ``[prompt | response]`` unpadded, rows right-padded to one
    length S; ``action_mask`` (B, S - 1) in OpenRLHF's shifted layout (entry t marks token t + 1 as an action).

    Prompts of different lengths (3..7 tokens), G responses per prompt (1..6 tokens), one response per batch of a
    single token. ``left_pad``: rows left-padded instead (older OpenRLHF). ``multi_turn``: the first row of each group
    has an observation (3 tokens, not actions) inside its response, as in agent runs. ``system_prompt > 0``: every
    prompt starts with the same ``system_prompt`` tokens, as chat templates with one system message make them.

    Returns (sequences (B, S) int64, attention_mask (B, S) int64, action_mask (B, S - 1) int64).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    system = (
        torch.randint(1, VOCAB, (system_prompt,), generator=gen) if system_prompt else torch.zeros(0, dtype=torch.long)
    )
    for _ in range(num_prompts):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen)
        prompt = torch.cat([system, prompt])
        for g in range(generations):
            response = torch.randint(1, VOCAB, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
            action = torch.ones_like(response)
            if multi_turn and g == 0:
                observation = torch.randint(1, VOCAB, (3,), generator=gen)
                response = torch.cat([response, observation, response[:2]])
                action = torch.cat([action, torch.zeros(3, dtype=torch.long), torch.ones(min(2, action.numel()))])
            rows.append((prompt, response, action.long()))
    rows[1] = (rows[1][0], rows[1][1][:1], rows[1][2][:1])
    length = max(p.numel() + r.numel() for p, r, _ in rows)
    sequences = torch.zeros((len(rows), length), dtype=torch.long)
    attention = torch.zeros_like(sequences)
    actions = torch.zeros_like(sequences)
    for i, (prompt, response, action) in enumerate(rows):
        tokens = torch.cat([prompt, response])
        start = length - tokens.numel() if left_pad else 0
        sequences[i, start : start + tokens.numel()] = tokens
        attention[i, start : start + tokens.numel()] = 1
        actions[i, start + prompt.numel() : start + tokens.numel()] = action
    return sequences, attention, actions[:, 1:]


def grpo_loss(actor, sequences, attention, actions, old, advantages):
    """OpenRLHF's GRPO loss on one micro-batch with its own ``PolicyLoss`` (PPO clip 0.2/0.28, token-mean) and an
    entropy term (coefficient 0.01): the action log-probs (B, S - 1) float32 and the scalar loss, both differentiable.
    """
    models = import_openrlhf()
    loss_fn = models.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, token_level_loss=True, policy_loss_type="ppo")
    log_probs, output = actor(sequences, actions, attention, return_output=True, return_entropy=True)
    loss = loss_fn(log_probs, old, advantages, action_mask=actions)[0]
    entropy = models.aggregate_loss(output.entropy[:, -actions.shape[1] :], actions)
    return log_probs, loss - 0.01 * entropy

"""A tiny GRPOTrainer built fully offline (random Qwen2 from a config, word-level tokenizer in memory), plus a
recorder of what the trainer computes, for comparing patched and unpatched runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

WORDS = "the a cat dog sat ran on mat rug and red blue big small one two three yes no".split()
SPECIALS = ["<pad>", "<eos>", "<unk>"]
PROMPTS = [
    "the cat sat on the mat",
    "a dog ran",
    "one two three",
    "the big red dog sat on a small blue rug",
    "yes",
    "no no yes and the cat",
    "two small dogs",
    "a red mat and a blue rug",
]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_model(seed: int = 0):
    """2-layer Qwen2 (GQA, attention biases, tied embeddings), float32, peaked enough that entropies spread."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def scripted_generate(monkeypatch, truncated_calls, *, eos_token_id: int = 1, pad_token_id: int = 0):
    """Replace the models' ``generate`` with a deterministic script: call ``i`` (0-based) continues every prompt with
    ``max_new_tokens`` random words; unless ``i in truncated_calls``, each row ends with EOS at a random length and is
    padded after it. A call in ``truncated_calls`` gives only truncated completions (no EOS), which
    ``mask_truncated_completions=True`` masks entirely. Both runs of a comparison see the same completions."""
    from transformers.generation.utils import GenerationMixin

    calls = []

    def generate(self, input_ids=None, generation_config=None, **kwargs):
        index = len(calls)
        calls.append(index)
        length = generation_config.max_new_tokens
        gen = torch.Generator().manual_seed(1000 + index)
        rows = input_ids.shape[0]
        completion = torch.randint(len(SPECIALS), len(SPECIALS) + len(WORDS), (rows, length), generator=gen)
        if index not in truncated_calls:
            ends = torch.randint(1, length, (rows,), generator=gen)  # EOS position; shorter than the limit
            columns = torch.arange(length)[None, :]
            completion[columns == ends[:, None]] = eos_token_id
            completion[columns > ends[:, None]] = pad_token_id
        return torch.cat([input_ids, completion.to(input_ids.device)], dim=1)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    return calls


def reward_len(prompts, completions, **kwargs):
    """Prefer completions of about 4 words."""
    return [-abs(len(c.split()) - 4) for c in completions]


@dataclass
class Record:
    """What one training run computed, in call order."""

    logps_calls: list = field(default_factory=list)  # (grad enabled, input_ids, logps, entropies or None)
    losses: list = field(default_factory=list)  # per micro-batch, as training_step returned them
    first_grads: dict = field(default_factory=dict)  # parameter name -> gradient before the first optimizer step
    learning_rates: list = field(default_factory=list)  # per optimizer step
    optimizer_steps: int = 0
    params: dict = field(default_factory=dict)  # after training
    global_step: int = 0
    log_history: list = field(default_factory=list)


def make_trainer(
    tmp_path,
    *,
    kind: str = "plain",
    seed: int = 0,
    trainer_class=None,
    model=None,
    reward_func=reward_len,
    prompts=None,
    **overrides,
):
    """A GRPOTrainer on the tiny model (or ``model``, whose vocabulary must fit the tokenizer's). ``kind``: ``plain``
    (model instance), ``ref`` (saved to a directory so TRL can build its reference model, for beta > 0), ``peft``
    (LoRA; reference = the disabled adapter). Other keyword arguments override ``GRPOConfig`` fields;
    ``reward_func`` replaces :func:`reward_len`; ``prompts`` (default: :data:`PROMPTS` four times) the dataset."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = build_tokenizer()
    model = build_model(seed) if model is None else model
    peft_config = None
    if kind == "ref":
        path = tmp_path / "tiny_qwen2"
        if not path.exists():
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        model = str(path)
    elif kind == "peft":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-3,  # Adam turns relative noise of near-zero gradient entries into lr-sized steps
        max_grad_norm=1e6,  # no clipping: clipping would hide a wrong gradient scale
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return (trainer_class or GRPOTrainer)(
        model=model,
        reward_funcs=reward_func,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4 if prompts is None else list(prompts)}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor; a sharded DTensor (FSDP2) is gathered (a collective: every process
    calls it, in the same order)."""
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


def record_training(trainer) -> Record:
    """Train (max_steps from the config) and record log-probs, losses, first gradients, LRs and steps.

    Wraps whatever the trainer's instance holds *now* (the patched methods, if it was patched), so the record shows
    what TRL received.
    """
    from transformers import TrainerCallback

    record = Record()
    logps_method = trainer._get_per_token_logps_and_entropies
    step_method = trainer.training_step

    def logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = logps_method(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        entropies = None if out[1] is None else out[1].detach().clone()
        record.logps_calls.append((torch.is_grad_enabled(), input_ids.clone(), out[0].detach().clone(), entropies))
        return out

    def training_step(*args, **kwargs):
        loss = step_method(*args, **kwargs)
        record.losses.append(float(loss))
        return loss

    class Spy(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            if record.optimizer_steps == 0:
                record.first_grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
            record.learning_rates.append(optimizer.param_groups[0]["lr"])

        def on_optimizer_step(self, args, state, control, **kwargs):
            record.optimizer_steps += 1

    trainer._get_per_token_logps_and_entropies = logps
    trainer.training_step = training_step
    trainer.add_callback(Spy())
    trainer.train()
    record.params = {name: full(p) for name, p in trainer.model.named_parameters() if p.requires_grad}
    record.global_step = trainer.state.global_step
    record.log_history = list(trainer.state.log_history)
    return record


def moe_model(family: str, seed: int = 0):
    """A 2-layer MoE (4 experts, 2 per token) over the tiny tokenizer's vocabulary.

    TRL enables the aux loss whenever the config has an ``output_router_logits`` attribute (every MoE config has it)
    and asks each policy forward for router logits itself. The config's flag stays False: set to True, transformers
    5.23's ``generate`` fails in the unpatched trainer already (each decoding step's aux loss pairs one step's router
    logits with the whole attention mask)."""
    import transformers as tf

    common = dict(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=1,
        num_experts_per_tok=2,
    )
    if family == "qwen3_moe":
        config, cls = tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16), tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config, cls = tf.MixtralConfig(**common, num_local_experts=4, sliding_window=6), tf.MixtralForCausalLM
    elif family == "glm4_moe":
        config = tf.Glm4MoeConfig(**common, n_routed_experts=4, moe_intermediate_size=16, first_k_dense_replace=1)
        cls = tf.Glm4MoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def hybrid_model(seed: int = 0):
    """A 3-layer Qwen3.5 (Gated DeltaNet, gated attention, Gated DeltaNet; tied embeddings) over the tiny tokenizer's
    vocabulary, float32, with moderate decays as ``support.hybrid_models.build_hybrid`` draws them."""
    from support.hybrid_models import draw_moderate_decays, hybrid_config, hybrid_model_class

    config = hybrid_config(
        "qwen3_5_text",
        vocab_size=len(SPECIALS) + len(WORDS),
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = hybrid_model_class("qwen3_5_text")(config)
    draw_moderate_decays(model)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model

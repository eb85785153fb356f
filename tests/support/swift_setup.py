"""ms-swift's real GRPO training, offline on CPU, for the ms-swift plug-in's tests: a tiny model and tokenizer saved to
disk, a local dataset, a reward plug-in file, and ``swift rlhf`` run through ms-swift's own entry point
(``swift.pipelines.rlhf_main``, what the ``swift rlhf`` command calls) with a recorder of what the trainer computes.

The tokenizer is ms-swift's Qwen2 tokenizer class over a byte-level vocabulary without merges (one token per byte)
plus Qwen's three chat tokens, so ms-swift's ``qwen2_5`` chat template encodes real text (its default system prompt,
the user's words, the completion) and decoding gives the generated text back to the reward function.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from support.trl_tiny import PROMPTS  # noqa: E402  (the TRL tests' prompts; that module imports no trainer)

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REWARD_PLUGIN = Path(__file__).with_name("swift_reward_plugin.py")
RECORD_PLUGIN = Path(__file__).with_name("swift_record_plugin.py")
REPO = Path(__file__).resolve().parents[2]
REWARD = "spl_letters"  # the reward function the plug-in file registers


def build_tokenizer():
    """Qwen2's tokenizer over the 256 byte symbols (no merges) and Qwen's chat tokens: 259 ids."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    for token in CHAT_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


def build_model(family: str, vocab_size: int, eos: int, pad: int, seed: int = 0):
    """A 2-layer Qwen2 (GQA, attention biases) or a 3-layer Qwen3.5 hybrid (Gated DeltaNet, gated attention, Gated
    DeltaNet), float32, with logits peaked enough that log-probs and entropies spread."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen2":
        config = tf.Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            initializer_range=0.2,
            pad_token_id=pad,
            eos_token_id=eos,
            bos_token_id=None,
        )
        model = tf.Qwen2ForCausalLM(config)
    elif family == "qwen3_5":
        from support.hybrid_models import draw_moderate_decays, hybrid_config, hybrid_model_class

        config = hybrid_config(
            "qwen3_5_text",
            vocab_size=vocab_size,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            initializer_range=0.2,
            pad_token_id=pad,
            eos_token_id=eos,
            bos_token_id=None,
        )
        model = hybrid_model_class("qwen3_5_text")(config)
        draw_moderate_decays(model)  # as support.hybrid_models.build_hybrid draws them
    else:
        raise ValueError(f"family must be 'qwen2' or 'qwen3_5', got {family!r}")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model


def build_tiny(root: Path, family: str = "qwen2", *, prompts=None, repeats: int = 8) -> tuple[Path, Path]:
    """Save the tiny model and tokenizer under ``root/family`` and a ``messages`` dataset (``prompts`` each ``repeats``
    times) beside it; returns ``(model_dir, dataset_file)``. Built once per folder."""
    model_dir = root / family
    dataset = root / f"{family}.jsonl"
    if not (model_dir / "config.json").exists():
        tokenizer = build_tokenizer()
        model = build_model(family, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    with open(dataset, "w") as f:
        for prompt in list(prompts or PROMPTS) * repeats:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    return model_dir, dataset


def grpo_arguments(model_dir: Path, dataset: Path, output_dir: Path, **overrides) -> list[str]:
    """``swift rlhf --rlhf_type grpo`` arguments for a float32 full-parameter run on CPU: 2 prompts x 4 generations per
    micro-batch, a reference model (``beta`` > 0), no clipping (it would hide a wrong gradient scale), AdamW.
    ``overrides`` replace or add arguments (``name=value``; a list value is passed as several words)."""
    settings = {
        "rlhf_type": "grpo",
        "model": str(model_dir),
        # ms-swift's qwen3_5 is the vision-language model: the text-only hybrid loads as an unregistered causal LM
        "model_type": "qwen2" if model_dir.name == "qwen2" else None,
        "template": "qwen2_5",
        "dataset": str(dataset),
        "external_plugins": [str(REWARD_PLUGIN)],
        "reward_funcs": REWARD,
        "tuner_type": "full",
        "torch_dtype": "float32",
        "num_generations": 4,
        "per_device_train_batch_size": 8,
        "max_completion_length": 10,
        "temperature": 0.9,
        "max_steps": 1,
        "beta": 0.04,
        "learning_rate": 1e-3,
        "max_grad_norm": 1e6,
        "optim": "adamw_torch",
        "seed": 0,
        "data_seed": 0,
        "output_dir": str(output_dir),
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "split_dataset_ratio": 0,
        "logging_steps": 1,
        "dataloader_num_workers": 0,
        "dataset_num_proc": 1,
        "use_hf": "true",
        "check_model": "false",
        "log_completions": "false",
        # A random model's flat distribution almost never samples EOS: stopping at any lowercase letter or digit
        # (about one draw in seven) ends completions at different lengths.
        "stop_words": list("abcdefghijklmnopqrstuvwxyz0123456789"),
    }
    settings.update(overrides)
    argv = []
    for name, value in settings.items():
        if value is None:
            continue
        argv.append(f"--{name}")
        argv.extend(str(v) for v in value) if isinstance(value, list) else argv.append(str(value))
    return argv


@dataclass
class Call:
    """One log-prob call: grad mode, ``role`` (``"policy"`` or ``"ref_model"``, by the model passed), the rows and
    masks it got, what it returned."""

    grad: bool
    role: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    logps: torch.Tensor
    entropies: torch.Tensor | None
    reference: torch.Tensor | None = None  # ms-swift's own log-probs of the same call (``with_reference``)


@dataclass
class Record:
    """What one ``swift rlhf`` run computed, in call order.

    Attributes:
        calls: per log-prob call, a :class:`Call`.
        losses: per micro-batch, as ``training_step`` returned them.
        first_grads: parameter name -> gradient before the first optimizer step.
        params: trainable parameter name -> value after training.
        embedded: per log-prob call, the token ids the input embedding received (a forward pre-hook), in order.
        trainer: the trainer (its patch and stats).
    """

    calls: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    first_grads: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    embedded: list = field(default_factory=list)
    log_history: list = field(default_factory=list)
    batches: list = field(default_factory=list)  # per call, (a copy of model_inputs, grpo_batch) as the trainer passed
    trainer: object = None


def _forget_imported_plugins() -> None:
    """ms-swift keeps each ``--external_plugins`` file imported for the process (by a hash of its path) and does not
    run it again: forget the files so that each run's flag takes effect as in a fresh ``swift rlhf`` process."""
    for name in [name for name in sys.modules if name.startswith("_swift_external_")]:
        del sys.modules[name]


def run_grpo(monkeypatch, argv: list[str], *, count_embedded: bool = False, with_reference: bool = False) -> Record:
    """Run ``swift rlhf`` with ``argv`` through ms-swift's own entry point in this process and record it.

    The recorder wraps what the trainer instance resolves when training starts (the plug-in's methods where the run
    installed them), so it sees what ms-swift's loss receives. ``count_embedded``: record the token ids the input
    embedding receives per call. ``with_reference``: also run ms-swift's own log-prob method (which the plug-in never
    replaces: ``_get_per_token_logps_and_entropies_single``) on every call's inputs, without gradient, so that every
    step compares against ms-swift on the same parameters."""
    from swift.pipelines import rlhf_main
    from swift.pipelines.train.sft import SwiftSft
    from transformers import TrainerCallback

    record = Record()
    original_train = SwiftSft.train

    def full(tensor):
        return tensor.detach().clone()

    def train(self, trainer):
        record.trainer = trainer
        logps_method = trainer._get_per_token_logps_and_entropies
        step_method = trainer.training_step

        def logps(model, model_inputs, grpo_batch, *args, **kwargs):
            hooks, embedded = [], []
            if count_embedded:
                embedding = trainer.accelerator.unwrap_model(model).get_input_embeddings()
                hooks.append(
                    embedding.register_forward_pre_hook(lambda m, args: embedded.append(args[0].detach().clone()))
                )
            try:
                out = logps_method(model, model_inputs, grpo_batch, *args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            role = "ref_model" if model is trainer.ref_model else "policy"
            entropies = None if out[1] is None else full(out[1])
            reference = None
            if with_reference:
                from swift.trainers import disable_gradient_checkpointing

                own = type(trainer)._get_per_token_logps_and_entropies_single
                with torch.no_grad(), disable_gradient_checkpointing(model, trainer.args.gradient_checkpointing_kwargs):
                    reference = own(trainer, model, dict(model_inputs), grpo_batch)[0]
            record.calls.append(
                Call(
                    torch.is_grad_enabled(),
                    role,
                    full(model_inputs["input_ids"]),
                    full(model_inputs["attention_mask"]),
                    full(grpo_batch.completion_mask),
                    full(out[0]),
                    entropies,
                    reference,
                )
            )
            record.embedded.append(embedded)
            record.batches.append((dict(model_inputs), grpo_batch))
            return out

        def training_step(*args, **kwargs):
            loss = step_method(*args, **kwargs)
            record.losses.append(float(loss))
            return loss

        class Spy(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if not record.first_grads:
                    record.first_grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

        trainer._get_per_token_logps_and_entropies = logps
        trainer.training_step = training_step
        trainer.add_callback(Spy())
        result = original_train(self, trainer)
        record.params = {n: full(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
        record.log_history = list(trainer.state.log_history)
        for name in ("_get_per_token_logps_and_entropies", "training_step"):  # the recorder leaves the trainer
            trainer.__dict__.pop(name, None)
        return result

    _forget_imported_plugins()
    monkeypatch.setattr(SwiftSft, "train", train)
    try:
        rlhf_main(argv)
    finally:
        monkeypatch.setattr(SwiftSft, "train", original_train)
    return record


def run_swift_command(argv: list[str], record_dir: Path, *, processes: int = 1, timeout_s: float = 600) -> list[dict]:
    """Run the ``swift rlhf`` command (the venv's ``swift`` script, fresh processes; ``processes`` > 1 launches them
    through torchrun as ms-swift does with ``NPROC_PER_NODE``) with :data:`RECORD_PLUGIN` added to the plug-in files;
    returns each rank's record (``support/swift_record_plugin.py``). Fails with the command's output on an error."""
    import subprocess

    from .distributed import free_port

    record_dir.mkdir(parents=True, exist_ok=True)
    argv = list(argv)
    at = argv.index("--external_plugins") + 1
    argv[at:at] = [str(RECORD_PLUGIN)]
    env = dict(os.environ, SHARED_PREFIX_LOGPS_SWIFT_TEST_RECORD=str(record_dir), CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")) if p)
    if processes > 1:
        env.update(NPROC_PER_NODE=str(processes), MASTER_PORT=str(free_port()))
    swift = Path(sys.executable).with_name("swift")
    run = subprocess.run([str(swift), "rlhf", *argv], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return [torch.load(record_dir / f"rank{rank}.pt") for rank in range(processes)]

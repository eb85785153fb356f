"""TRL GRPOTrainer with shared-prefix log-probs, on CPU, fully offline, in a few seconds.

A tiny random Qwen2 built from a config, a word-level tokenizer built in memory, an in-memory dataset of plain-text
prompts and a length reward. The trainer is patched in one line, trained for a few steps, and the patch reports
what it did: how many tokens the shared path forwarded instead of the full rows, and the self-check against TRL's
own log-prob computation.

    python examples/grpo_tiny_cpu.py                  # mode="logps"
    python examples/grpo_tiny_cpu.py --mode chunked   # also the chunked backward
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

WORDS = "the a cat dog sat ran on mat rug and red blue big small one two three yes no".split()
# Long-ish prompts, short completions: the case shared prefixes are for
PROMPTS = [
    "the big red dog sat on a small blue rug and the cat sat on the mat",
    "one two three one two three and a dog ran on the red rug",
    "a small cat and a big dog ran on the blue mat yes no yes",
    "the red mat and the blue rug and the big cat sat on one",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_model(vocab_size: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def reward_len(prompts, completions, **kwargs):
    """Prefer completions of about 4 words."""
    return [-abs(len(completion.split()) - 4) for completion in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["logps", "chunked"], default="logps")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' gradient_checkpointing renames
    torch.manual_seed(0)

    tokenizer = build_tokenizer()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_tiny_"),
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults to bf16
        gradient_checkpointing=False,
        per_device_train_batch_size=8,  # completion rows per micro-batch
        num_generations=8,  # G completions per prompt
        max_completion_length=6,
        temperature=0.8,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=build_model(len(tokenizer)),
        reward_funcs=reward_len,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
    )

    trainer.remove_callback(PrinterCallback)  # keep the output short; the losses are printed below

    patch = patch_grpo_trainer(trainer, mode=args.mode)  # <- the one line

    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [round(entry["loss"], 4) for entry in trainer.state.log_history if "loss" in entry]
    print(f"\nmode={args.mode}: {trainer.state.global_step} optimizer steps in {seconds:.1f}s, losses {losses}")
    print(patch.stats.summary())


if __name__ == "__main__":
    main()

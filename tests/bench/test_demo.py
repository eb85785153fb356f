"""The main job (`make demo`) on its default CPU shape: exact, real token counts, and at least half the speed-up the
FLOP floor allows."""

import torch

from shared_prefix_logps.bench.demo import main
from shared_prefix_logps.bench.presets import PRESETS
from shared_prefix_logps.bench.runner import Shape, make_batch


def test_demo_default_shape(capsys):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        figures = main(["--device", "cpu", "--preset", "tiny", "--prompt-len", "256", "--completion-len", "32"])
        assert torch.get_num_threads() == 1  # the demo's CPU default: one thread
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    # 4 prompts of 256, 213, 171 and 128 real tokens (not 4 x 256), G=8 completions of 16..32 real tokens each.
    batch = make_batch(Shape(4, 256, 32, 8), PRESETS["tiny"].vocab, "cpu")
    prompt_tokens, completion_tokens = int(batch.prompt_mask.sum()), int(batch.completion_mask.sum())
    assert batch.prompt_mask.sum(1).tolist() == [256, 213, 171, 128]
    dense, shared = 8 * prompt_tokens + completion_tokens, prompt_tokens + completion_tokens
    assert f"real tokens forwarded: dense {dense:,}  shared {shared:,}" in printed
    assert (figures["dense_tokens"], figures["shared_tokens"]) == (dense, shared)
    assert figures["token_floor"] < figures["flop_floor"] < 1
    assert figures["max_abs_diff"] <= 1e-5
    assert figures["speedup"] >= 0.5 / figures["flop_floor"], figures
    assert figures["memory_ratio"] < 0.5, figures

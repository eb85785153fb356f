"""The main job (`make demo`) on its default CPU shape: exact, and at least half the token-floor speed-up."""

import torch

from shared_prefix_logps.bench.demo import main


def test_demo_default_shape(capsys):
    argv = ["--device", "cpu", "--preset", "tiny", "--prompt-len", "256", "--completion-len", "32"]
    # One thread: another process on a core then slows both paths alike instead of stalling the many small ops of
    # the shared path at every thread barrier.
    threads = torch.get_num_threads()
    try:
        figures = main([*argv, "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "tokens forwarded: dense 9,216  shared 2,048" in printed
    assert figures["max_abs_diff"] <= 1e-5
    floor_speedup = 1 / figures["token_floor"]  # 4.5x at 4 prompts x G=8, P=256, C=32
    assert figures["speedup"] >= 0.5 * floor_speedup, figures
    assert figures["memory_ratio"] < 0.5, figures

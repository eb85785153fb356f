"""What the plan's expand and head terms depend on beyond the shapes: padded prompts, sliding windows, the fused
head's implementation, and the options that set them (named when they are wrong)."""

import json

import pytest

from shared_prefix_logps.cli import main
from shared_prefix_logps.plan import Engine, Workload, bench_workload, plan_memory
from shared_prefix_logps.plan.dims import dims_from_config, dims_from_preset
from shared_prefix_logps.plan.memory import MemoryPlan, expand_terms, scoring_chunk

CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=4096,
)


def test_prompts_need_no_mask_and_unpadded_prompts_share_one_row_mask():
    # The prompts' node call runs causal SDPA, padded or not (a node's padding follows its tokens); the completions'
    # call shares one mask row when every prompt has P real tokens.
    dims = dims_from_config(CONFIG)
    padded = expand_terms(dims, Workload(2, 512, 64, 8), Engine(), rows=16)
    unpadded = expand_terms(dims, Workload(2, 512, 64, 8, padded_prompts=False), Engine(), rows=16)
    assert padded["prompt mask"] == unpadded["prompt mask"] == 0
    assert padded["row masks"] == 16 * unpadded["row masks"] == 16 * 64 * 576 * 2
    assert padded["gathered K/V (one layer)"] == unpadded["gathered K/V (one layer)"]


def test_a_window_shorter_than_the_keys_needs_the_masks_of_padded_prompts():
    unpadded = Workload(1, 512, 64, 8, padded_prompts=False)
    for window, expected in ((4096, 0), (300, 512 * 512 * 2)):
        dims = dims_from_config({**CONFIG, "sliding_window": window})
        terms = expand_terms(dims, unpadded, Engine(), rows=8)
        assert terms["prompt mask"] == expected, window
        assert terms["row masks"] == (1 if window == 4096 else 8) * 64 * 576 * 2, window


def test_sliding_windows_are_read_as_transformers_reads_them():
    assert dims_from_preset("gemma-2-2b").sliding_window == 4096
    assert dims_from_preset("qwen2.5-7b").sliding_window is None
    # Qwen2 configs carry a window that use_sliding_window=False turns off.
    off = dims_from_config({**CONFIG, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert off.sliding_window is None


def test_torch_head_statistics_hold_float32_temporaries_on_cuda_too():
    dims = dims_from_config(CONFIG)
    w = Workload(1, 64, 128, 4, mode="score")
    triton = plan_memory("expand", dims, w, Engine(head_implementation="triton"))
    torch_stats = plan_memory("expand", dims, w, Engine(head_implementation="torch"))
    rows = 4 * 128 - 4  # each row's first token is scored by the prompts' node call
    assert triton.terms["head chunk"] == rows * 4096 * 2  # bf16 logits, statistics in place
    assert torch_stats.terms["head chunk"] == rows * 4096 * (2 + 4)  # and a float32 copy
    assert Engine().head_statistics == "triton" and Engine(device="cpu").head_statistics == "torch"


def test_bench_workload_knows_whether_its_prompts_are_padded():
    # bench's batches: one prompt of exactly P; more prompts of P down to P/2, left-padded.
    assert not bench_workload(1, 64, 16, 4).padded_prompts
    assert bench_workload(2, 64, 16, 4).padded_prompts


def test_contradicting_options_are_refused_by_name():
    with pytest.raises(ValueError, match="padded_prompts"):
        Workload(2, 64, 16, 4, prompt_tokens=100, padded_prompts=False)
    with pytest.raises(ValueError, match="head_implementation"):
        Engine(head_implementation="cuda")
    with pytest.raises(ValueError, match="head_implementation 'triton' runs on cuda only"):
        Engine(device="cpu", head_implementation="triton")


def test_cli_options_reach_the_plan(capsys):
    base = ["plan", "--model", "qwen2.5-0.5b", "--prompt-len", "1024", "--completion-len", "256"]
    base += ["--generations", "8", "--methods", "expand", "--json"]
    assert main(base) == 0
    padded = json.loads(capsys.readouterr().out)
    assert main([*base, "--unpadded-prompts", "--head-implementation", "torch"]) == 0
    unpadded = json.loads(capsys.readouterr().out)
    assert padded["workload"]["padded_prompts"] and not unpadded["workload"]["padded_prompts"]
    (padded_terms,), (unpadded_terms,) = ([r["breakdown"] for r in out["methods"]] for out in (padded, unpadded))
    assert padded_terms["row masks"] == 16 * unpadded_terms["row masks"]  # B x G = 16 rows, or one row's mask
    assert "prompt mask" not in padded_terms and "prompt mask" not in unpadded_terms  # the prompts' call is causal
    with pytest.raises(SystemExit) as raised:
        main([*base, "--head-implementation", "cuda"])
    assert str(raised.value).startswith("shared-prefix-logps plan: --head-implementation:"), str(raised.value)


def _moment_with(memory: MemoryPlan, name: str) -> dict:
    """The first moment of ``memory`` that has a term ``name``."""
    return next(moment for moment in memory.moments if name in moment)


def test_triton_head_backward_holds_a_chunk_of_logits_in_their_dtype_and_kept_logits_are_the_chunks():
    """The Triton statistics write d logits over the logits, in the matmul's dtype (``chunk_logit_bytes``; the
    fused head's tests measure a chunk's backward within its budget): backward holds one chunk of logits, not a second
    copy for a cast. Logits kept from forward are the chunks themselves: nothing beside them with Triton, the torch
    statistics' float32 temporaries with torch."""
    import torch

    from shared_prefix_logps.kernels.fused_head import chunk_logit_bytes

    dims = dims_from_config(CONFIG)
    w = Workload(1, 64, 128, 4, mode="train")
    rows = 4 * 128 - 4
    per_logit = chunk_logit_bytes(torch.bfloat16, None)
    triton = plan_memory("expand", dims, w, Engine(head_implementation="triton"))
    assert _moment_with(triton, "head input grad")["head chunk"] == rows * 4096 * per_logit
    torch_stats = plan_memory("expand", dims, w, Engine(head_implementation="torch"))
    assert _moment_with(torch_stats, "head input grad")["head chunk"] == rows * 4096 * (per_logit + 12)
    chunked = Workload(1, 64, 128, 4, mode="train", generations_per_chunk=4)
    kept = plan_memory("chunked", dims, chunked, Engine(head_implementation="triton"))
    assert all("head chunk" not in moment for moment in kept.moments if "kept logits" in moment)
    assert _moment_with(kept, "kept logits")["kept logits"] == rows * 4096 * per_logit
    kept_torch = plan_memory("chunked", dims, chunked, Engine(head_implementation="torch"))
    forward = next(m for m in kept_torch.moments if "kept logits" in m and "head input grad" not in m)
    assert forward["head chunk"] == rows * 4096 * 4  # the float32 copy beside the chunk's kept logits


def test_an_unknown_kernel_plans_both_cuts_of_the_no_grad_rows():
    """Whether the CUDA kernel repeats grouped KV heads decides how many rows the token budget lets a no-grad call
    take (a repeat makes a row cost more): not known (None), the plan's peak is the larger of the two; with gradients
    the repeated copies are counted (the upper bound)."""
    dims = dims_from_config({**CONFIG, "vocab_size": 65536})  # head-bound: more rows per call, a larger peak
    score = Workload(1, 2048, 256, 16, mode="score", padded_prompts=False)
    peaks = {r: plan_memory("expand", dims, score, Engine(repeats_kv=r)).peak_bytes for r in (None, True, False)}
    assert peaks[False] > peaks[True] and peaks[None] == peaks[False]
    rows = {r: scoring_chunk(dims, score, Engine(repeats_kv=r), "expand")[1] for r in (True, False)}
    assert rows[False] > rows[True]
    train = Workload(1, 2048, 256, 16, mode="train")
    with_repeat = plan_memory("expand", dims, train, Engine(repeats_kv=True))
    assert plan_memory("expand", dims, train, Engine()).peak_bytes == with_repeat.peak_bytes
    assert "prompt repeated K/V (saved)" not in plan_memory("expand", dims, train, Engine(repeats_kv=False)).terms
    assert plan_memory("expand", dims, score, Engine(device="cpu", repeats_kv=True)).peak_bytes == (
        plan_memory("expand", dims, score, Engine(device="cpu")).peak_bytes
    )  # no fused kernel on CPU


def test_the_token_budget_cuts_the_no_grad_rows():
    dims = dims_from_config(CONFIG)
    w = Workload(1, 512, 64, 32, mode="score", padded_prompts=False)
    default = scoring_chunk(dims, w, Engine(), "flex")[1]
    assert default == 32  # 512 + 32 x 64 tokens fit the default budget of 32,768
    assert scoring_chunk(dims, Workload(**{**w.__dict__, "token_budget": 512 + 4 * 64}), Engine(), "flex")[1] == 4
    with pytest.raises(ValueError, match="token_budget"):
        Workload(1, 512, 64, 32, token_budget=0)
    with pytest.raises(TypeError, match="repeats_kv"):
        Engine(repeats_kv="no")


def test_token_budget_and_kernel_options_reach_the_plan(capsys):
    base = ["plan", "--model", "qwen2.5-1.5b", "--prompt-len", "4096", "--completion-len", "512"]
    base += ["--generations", "16", "--workload", "score", "--unpadded-prompts", "--methods", "expand", "--json"]
    peaks = {}
    for option in ([], ["--sdpa-repeats-kv", "yes"], ["--sdpa-repeats-kv", "no"], ["--token-budget", "4096"]):
        assert main([*base, *option]) == 0
        out = json.loads(capsys.readouterr().out)
        peaks[" ".join(option)] = out["methods"][0]["peak_bytes"]
        assert out["workload"]["token_budget"] == (4096 if "--token-budget" in option else None)
    # Without a repeat a row costs less of the budget: more rows per call, a larger head chunk; not known, the larger.
    assert peaks["--sdpa-repeats-kv no"] > peaks["--sdpa-repeats-kv yes"]
    assert peaks[""] == peaks["--sdpa-repeats-kv no"]
    assert peaks["--token-budget 4096"] < peaks[""]
    with pytest.raises(SystemExit) as raised:
        main([*base, "--token-budget", "0"])
    assert str(raised.value).startswith("shared-prefix-logps plan: --token-budget: token_budget must be positive")
    with pytest.raises(SystemExit) as raised:
        main([*base, "--sdpa-repeats-kv", "maybe"])
    assert raised.value.code == 2 and "--sdpa-repeats-kv: invalid choice: 'maybe'" in capsys.readouterr().err
    assert main([*base[:-1], "--token-budget", "4096"]) == 0
    assert "within token_budget=4096" in capsys.readouterr().out

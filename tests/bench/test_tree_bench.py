"""The tree benchmark: each method computes the dense log-probs and gradients, forwards the tokens its record
counts (an embedding pre-hook counts them), and the CLI runs end to end on a tiny model in seconds."""

import json

import pytest
import torch
from support.exactness import max_relative_grad_error
from support.tiny_models import VOCAB, build_model

from shared_prefix_logps.bench.flops import ModelShape
from shared_prefix_logps.bench.tree_flops import method_flops
from shared_prefix_logps.bench.tree_methods import TREE_METHODS, TreeCase
from shared_prefix_logps.bench.tree_report import readme_table
from shared_prefix_logps.bench.tree_workloads import agentic, forks, forwarded_tokens, turns
from shared_prefix_logps.cli import main

SMALL = [
    # A system prompt long enough that compute_logps would take the searched trie, were deeper sharing not off.
    agentic(prompts=2, system=80, task=3, generations=3, completion=8, tool_spans=1, tool_length=2, vocab=VOCAB),
    turns(conversations=2, num_turns=3, system=5, user=2, response=3, vocab=VOCAB),
    forks(prompts=2, prompt_length=4, completions=4, completion=6, vocab=VOCAB),
]


@pytest.fixture(scope="module")
def model():
    return build_model("qwen2", dtype=torch.float64)


def _embedded(model, step, case, train):
    counts = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: counts.append(args[0].numel()))
    try:
        logps = step(model, case, train)
    finally:
        hook.remove()
    return logps, sum(counts)


@pytest.mark.parametrize("workload", SMALL, ids=lambda w: w.name)
def test_each_method_forwards_what_its_record_counts_and_scores_as_dense(model, workload):
    case = TreeCase.of(workload, "cpu", dense_tokens=40)  # several dense micro-batches
    counts = forwarded_tokens(workload)
    for method in TREE_METHODS:  # the first call of the shared path checks the head with a forward of its own
        TREE_METHODS[method](model, case, False)
    reference, dense_tokens = _embedded(model, TREE_METHODS["dense"], case, False)
    assert dense_tokens == counts["dense"]
    assert reference[~workload.score_mask].eq(0).all() and reference[workload.score_mask].lt(0).all()
    for method in ("two_level", "tree"):
        logps, tokens = _embedded(model, TREE_METHODS[method], case, False)
        # tree: each trie token once; two_level: each distinct prompt part once, though the prompts share a system
        # prompt (deeper sharing off), then every completion: the two-level trie's real tokens, packed, no padding.
        assert tokens == counts[method], (method, tokens, counts)
        torch.testing.assert_close(logps, reference.float(), rtol=0, atol=1e-6)
    assert counts["two_level"] > counts["tree"] or workload.name != "agentic"


@pytest.mark.parametrize("workload", SMALL, ids=lambda w: w.name)
def test_each_train_step_gives_dense_gradients(model, workload):
    case = TreeCase.of(workload, "cpu", dense_tokens=40)
    grads = {}
    for method, step in TREE_METHODS.items():
        model.zero_grad(set_to_none=True)
        step(model, case, True)
        grads[method] = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for method in ("two_level", "tree"):
        # A float64 model: what is left is the shared path's float32 log-probs.
        assert max_relative_grad_error(grads[method], grads["dense"]) < 1e-5, method


def test_flops_of_the_agentic_preset_by_hand():
    shape = ModelShape(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, windows=(None,))
    w = agentic(prompts=2, system=6, task=2, generations=2, completion=4, tool_spans=1, tool_length=1, vocab=VOCAB)
    flops = method_flops(shape, w, train=False)
    body, pair, head = shape.body_per_token, shape.attention_per_pair, shape.head_per_token
    # dense: 4 rows of 12 tokens, causal; 3 scored tokens a row (one tool token unscored).
    assert flops["dense"].total == 4 * 12 * body + 4 * (12 * 13 // 2) * pair + 12 * head
    # two_level: 2 prompts of 8, 4 completions of 4 after them, every completion token through the head.
    one_pairs = 2 * (8 * 9 // 2) + 4 * (4 * 8 + 4 * 5 // 2)
    assert flops["two_level"].total == (2 * 8 + 16) * body + one_pairs * pair + 16 * head
    # tree: the system prompt once, each task once, each completion once; 12 distinct scored pairs.
    tree_pairs = 6 * 7 // 2 + 2 * (2 * 6 + 2 * 3 // 2) + 4 * (4 * 8 + 4 * 5 // 2)
    assert flops["tree"].total == flops["unique"].total == (6 + 4 + 16) * body + tree_pairs * pair + 12 * head
    assert method_flops(shape, w, train=True)["tree"].total == 3 * flops["tree"].total


def test_cli_runs_the_tree_bench_end_to_end(tmp_path):
    options = ["prompts=2", "system=24", "task=4", "generations=2", "completion=8", "tool_length=2"]
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--tree-workload",
            "agentic",
            "--repeats",
            "1",
        ]
        + [arg for option in options for arg in ("--tree-option", option)]
        + ["--output", str(tmp_path), "--name", "tree"]
    )
    assert code == 0
    data = json.loads((tmp_path / "tree.json").read_text())
    assert data["meta"]["tree_options"]["system"] == 24 and data["meta"]["scale"].startswith("scaled: prompts=2")
    records = data["records"]
    assert [(r["workload"], r["method"]) for r in records] == [
        (w, m) for w in ("score", "train") for m in ("dense", "two_level", "tree")
    ]
    workload = agentic(**{**data["meta"]["tree_options"]})
    counts = forwarded_tokens(workload)
    for r in records:
        assert r["status"] == "ok", r
        assert r["tokens_forwarded"] == counts[r["method"]]
        assert r["peak_bytes"] > 0 and r["median_ms"] > 0 and len(r["times_ms"]) == 1
        assert r.get("max_abs_diff_vs_dense", 0.0) < 1e-4
        assert r["speedup"] == pytest.approx(
            records[0 if r["workload"] == "score" else 3]["median_ms"] / r["median_ms"]
        )
    assert records[0]["micro_batches"] >= 1
    assert "| score | tree | ok |" in (tmp_path / "tree.md").read_text()
    table = readme_table([(data["meta"], records)]).splitlines()
    assert len(table) == 6 and table[-2].startswith("| agentic (scaled) | score |"), table


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tree-option", "prompts"], "KEY=VALUE"),
        (["--tree-option", "nope=1"], "unknown to agentic"),
        (["--methods", "dense,expand"], "unknown method(s) ['expand']"),
        (["--tree-option", "prompts=0"], "agentic: no rows"),
        (["--tree-option", "generations=0"], "agentic: no rows"),
        (["--tree-option", "completion=0"], "scores no token"),
        (["--tree-option", "system=-4"], "['system'] must not be negative"),
        (["--tree-option", "vocab=9000"], "vocab=9000 must be in [1, 8192]"),
    ],
)
def test_cli_refuses_bad_tree_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as error:
        main(["bench", "--preset", "tiny", "--layers", "1", "--tree-workload", "agentic", *args])
    assert message in str(error.value)


def test_a_smaller_vocabulary_option_is_taken():
    """``vocab`` is a builder keyword like the others (token ids below it); the model's own is the default."""
    from shared_prefix_logps.bench.tree_runner import build_workload

    workload, kwargs = build_workload("forks", {"vocab": 500, "prompts": 1, "completions": 2, "completion": 4}, 8192)
    assert kwargs["vocab"] == 500 and int(workload.input_ids.max()) < 500

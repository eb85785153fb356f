"""Tree workloads: their shapes, and the tokens each method forwards (the tree's count is what the model embeds)."""

import torch
from support.tiny_models import VOCAB, build_model

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.bench.tree_workloads import agentic, forks, forwarded_tokens, turns


def test_agentic_preset_counts():
    counts = forwarded_tokens(agentic())
    # 16 prompts of 2048 + 256 tokens, 8 completions of 512 each.
    assert counts["dense"] == 128 * (2048 + 256 + 512)
    assert counts["two_level"] == 16 * (2048 + 256) + 128 * 512
    assert counts["tree"] == counts["unique"] == 2048 + 16 * 256 + 128 * 512


def test_small_workloads_embed_the_tree_count():
    model = build_model("qwen2")
    small = [
        agentic(prompts=2, system=9, task=3, generations=3, completion=8, tool_spans=1, tool_length=2, vocab=VOCAB),
        turns(conversations=2, num_turns=3, system=5, user=2, response=3, vocab=VOCAB),
        forks(prompts=2, prompt_length=4, completions=4, completion=6, vocab=VOCAB),
    ]
    embedded = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, a: embedded.append(a[0].numel()))
    for workload in small:
        counts = forwarded_tokens(workload)
        assert counts["dense"] >= counts["two_level"] >= counts["tree"], (workload.name, counts)
        assert counts["tree"] < counts["dense"], workload.name
        args = (workload.input_ids, workload.attention_mask, workload.score_mask)
        with torch.no_grad():  # the count is the trie's: tiny nodes unmerged
            compute_logps_tree(model, *args)  # the first call checks the head with a forward of its own
            embedded.clear()
            compute_logps_tree(model, *args, merge_tiny_nodes=False)
        assert sum(embedded) == counts["tree"], workload.name
    hook.remove()

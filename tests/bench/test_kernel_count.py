"""The GPU's pace, held on CPU: what each method's step would cost a GPU's host, counted on Qwen2.5-1.5B's structure
(28 layers, 12 query and 2 KV heads) with narrow widths, scoring at G=16 and training at G=4, as the committed GPU
runs measured them (``bench/kernel_count.py``; its calibration against those runs is in docs/benchmarks.md).

- the layout whose calls hold every depth (``flex``) runs a grouped scoring step, a grouped training step, a chunked
  backward that fits one chunk and a depth-3 trie's scoring step as one model call within 1.3x dense's kernels;
- every layout within 1.3x (scoring) and 1.4x (training) of dense's kernels per node call;
- ``chunked_backward`` with one generation per chunk within (chunks + 1) x 1.3 of dense's training step, and at most
  one gradient addition per chunk;
- at most 5 host syncs per step, plus one per forced chunk, and the same count at 4 layers as at 28: none in the
  layer loop.
"""

import pytest

from shared_prefix_logps.bench.kernel_count import count_methods, grouped_batch, narrow_model

PRESET = "qwen2.5-1.5b"
SCORE_G, TRAIN_G = 16, 4


def _records(layers=None):
    model = narrow_model(PRESET, layers=layers)
    batches = {"score": grouped_batch(2, SCORE_G, 64, 16), "train": grouped_batch(2, TRAIN_G, 64, 16)}
    return model.config.num_hidden_layers, {(r["method"], r["step"]): r for r in count_methods(model, batches)}


@pytest.fixture(scope="module")
def records():
    layers, found = _records()
    assert layers == 28
    return found


@pytest.fixture(scope="module")
def shallow():
    return _records(layers=4)[1]


def test_the_layout_of_every_depth_runs_a_step_in_one_call_within_1_3x_dense(records):
    for key in (("flex", "score"), ("flex", "train"), ("chunked-flex", "train"), ("tree-flex", "score")):
        record = records[key]
        assert record["node_calls"] == 1, record
        assert record["x_dense"] <= 1.3, record


@pytest.mark.parametrize("layout", ["expand", "flex"])
def test_every_layout_per_node_call(records, layout):
    assert records[(layout, "score")]["x_dense_per_call"] <= 1.3, records[(layout, "score")]
    assert records[(layout, "train")]["x_dense_per_call"] <= 1.4, records[(layout, "train")]
    assert records[(f"tree-{layout}", "score")]["x_dense_per_call"] <= 1.3


@pytest.mark.parametrize("layout", ["expand", "flex"])
def test_forced_chunks(records, layout):
    chunks = TRAIN_G  # one generation per chunk
    record = records[(f"chunked-{layout}/1", "train")]
    dense = records[("dense", "train")]["kernels"]
    assert record["node_calls"] == chunks + 1, record  # the prompts' call and one per chunk
    assert record["kernels"] <= (chunks + 1) * 1.3 * dense, record
    assert record["grad_additions"] <= chunks, record


def test_host_syncs_per_step_and_none_in_the_layer_loop(records, shallow):
    for (method, step), record in records.items():
        forced = TRAIN_G if method.endswith("/1") else 0
        assert record["host_syncs"] <= 5 + forced, record
        assert record["host_syncs"] == shallow[(method, step)]["host_syncs"], (record, shallow[(method, step)])
        assert record["sync_sites"] == shallow[(method, step)]["sync_sites"]


@pytest.mark.parametrize("train", [False, True], ids=["score", "train"])
def test_a_hybrid_call_runs_its_recurrent_layers_once_whatever_its_node_lengths(train):
    """A tiny Qwen3.5: a call of 8 completions of one length and one of 8 distinct lengths dispatch the same kernels
    (each Gated DeltaNet layer runs its nodes in one padded call, not one per length), with the same host syncs."""
    import torch
    from support.hybrid_models import build_hybrid

    from shared_prefix_logps import compute_logps
    from shared_prefix_logps.bench.dispatch_count import count_step

    model = build_hybrid("qwen3_5_text")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(1, vocab, (1, 12), generator=gen)
    counted = {}
    for lengths in ([6] * 8, [3, 4, 5, 6, 7, 8, 9, 10]):
        completions = torch.randint(1, vocab, (8, 10), generator=gen)
        mask = torch.arange(10)[None] < torch.tensor(lengths)[:, None]

        def step(completions=completions, mask=mask):
            with torch.set_grad_enabled(train):
                out = compute_logps(model, prompts, completions, completion_mask=mask)
                if train:
                    out.logps.sum().backward()

        step()
        model.zero_grad(set_to_none=True)
        counted[len(set(lengths))] = count_step(step, model, [prompts, completions, mask])
        model.zero_grad(set_to_none=True)
    assert counted[1].kernels == counted[8].kernels, (counted[1].num_kernels, counted[8].num_kernels)
    assert counted[1].num_syncs == counted[8].num_syncs <= 5, (counted[1].syncs, counted[8].syncs)


def _committed_counts():
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

    def is_count(path):
        data = json.loads(path.read_text())
        return isinstance(data, dict) and data.get("meta", {}).get("count") == "kernels"

    return [path for path in sorted(results.glob("*.json")) if is_count(path)]


@pytest.mark.parametrize("path", _committed_counts(), ids=lambda p: p.name)
def test_committed_counts_hold_their_ratios_and_the_targets(path):
    """A committed ``bench --count-kernels`` file: its ratios are its kernels over its dense step's, it records the
    commit and versions it counted, and the one-call, per-call and sync targets above held there."""
    import json

    data = json.loads(path.read_text())
    assert data["meta"]["commit"] and data["meta"]["versions"]["torch"]
    found = {(r["method"], r["step"]): r for r in data["records"]}
    for (method, step), record in found.items():
        dense = found[("tree-dense" if method.startswith("tree-") else "dense", step)]
        assert record["x_dense"] == pytest.approx(record["kernels"] / dense["kernels"], abs=0.005), record
        assert record["host_syncs"] == sum(record["sync_sites"].values()), record
    test_the_layout_of_every_depth_runs_a_step_in_one_call_within_1_3x_dense(found)
    for layout in ("expand", "flex"):
        test_every_layout_per_node_call(found, layout)
        test_forced_chunks(found, layout)

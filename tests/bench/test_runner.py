"""The benchmark runner: real-token counts, pad-free dense reference, interleaved timing."""

import pytest
import torch

from shared_prefix_logps.bench import methods, runner
from shared_prefix_logps.bench.flops import ModelShape, Workload, flop_floor
from shared_prefix_logps.bench.presets import build_preset
from shared_prefix_logps.bench.runner import Shape, make_batch, run_cell, work_counts

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(scope="module")
def model():
    return build_preset("tiny", layers=1).train(False)


def test_one_prompt_of_length_p_has_p_real_tokens(model):
    batch = make_batch(Shape(1, 24, 6, 3), model.config.vocab_size, "cpu")
    assert batch.prompt_mask.all() and batch.prompt_mask.shape == (1, 24)
    counts = work_counts(model.config, batch, train=False)
    completion_tokens = int(batch.completion_mask.sum())
    assert counts["prompt_tokens"] == 24
    assert counts["completion_tokens"] == completion_tokens and batch.completion_mask[0].all()
    assert counts["dense_tokens"] == 3 * 24 + completion_tokens
    assert counts["shared_tokens"] == 24 + completion_tokens
    assert counts["token_floor"] == (24 + completion_tokens) / (3 * 24 + completion_tokens)


def test_several_prompts_the_longest_is_p(model):
    batch = make_batch(Shape(4, 24, 6, 2), model.config.vocab_size, "cpu")
    lengths = batch.prompt_mask.sum(1).tolist()
    assert lengths[0] == 24 and max(lengths) == 24 and min(lengths) == 12 and len(set(lengths)) == 4
    counts = work_counts(model.config, batch, train=True)
    assert counts["prompt_tokens"] == sum(lengths)
    assert counts["dense_tokens"] == 2 * sum(lengths) + int(batch.completion_mask.sum())


def test_shape_refuses_bad_sizes():
    with pytest.raises(ValueError, match="prompt_len"):
        Shape(1, 0, 4, 2)
    with pytest.raises(ValueError, match="generations"):
        Shape(1, 8, 4, 2.5)


def test_records_carry_real_counts_and_floors(model):
    shape = Shape(2, 20, 5, 3)
    records = run_cell(model, ["dense", "expand", "kv_expand"], shape, "train", repeats=1)
    batch = make_batch(shape, model.config.vocab_size, "cpu")
    workload = Workload.from_masks(batch.prompt_mask, batch.completion_mask)
    floor = flop_floor(ModelShape.from_config(model.config), workload, train=True)
    assert [r["method"] for r in records] == ["dense", "expand", "kv_expand"]
    for record in records:
        assert record["status"] == "ok", record
        assert record["prompt_tokens"] == workload.prompt_tokens < shape.prompts * shape.prompt_len
        assert record["dense_tokens"] == workload.dense_tokens
        assert record["shared_tokens"] == workload.shared_tokens
        assert record["flop_floor"] == floor and record["token_floor"] < floor < 1
        assert record["tokens_per_s"] == pytest.approx(workload.dense_tokens / (record["median_ms"] / 1e3))
        assert record["peak_bytes"] > 0
    assert records[1]["max_abs_diff_vs_dense"] <= 1e-5 and records[2]["max_abs_diff_vs_dense"] <= 1e-5


def test_dense_reference_does_no_padding_work(model):
    """Prompts of different lengths: the dense method forwards each row's real prompt tokens and its completion
    slots (not pads up to the longest prompt), without a padding mask (so attention runs causal, computing the
    pairs the FLOP floor counts), and computes what the padded, masked full rows compute, gradients included."""
    batch = make_batch(Shape(3, 20, 5, 2), model.config.vocab_size, "cpu")
    lengths = batch.prompt_mask.sum(1)
    assert len(set(lengths.tolist())) == 3 and not batch.completion_mask.all()
    calls = []

    def record(module, args, kwargs):
        calls.append((kwargs["input_ids"].shape, kwargs.get("attention_mask")))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        model.zero_grad(set_to_none=True)
        ours = methods.METHODS["dense"][0](model, batch, True)
    finally:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    # Per prompt: its G rows of its real length plus their completion slots (cut to their longest completion).
    completion_lengths = batch.completion_mask.sum(1).view(3, 2)
    expected = sorted((2, int(p) + int(c.max())) for p, c in zip(lengths, completion_lengths))
    assert sorted(tuple(shape) for shape, _ in calls) == expected
    assert all(mask is None for _, mask in calls)
    model.zero_grad(set_to_none=True)
    padded = methods.compute_logps_step("dense")(model, batch, True)
    assert (ours - padded).abs().max() <= 1e-5 and (ours[~batch.completion_mask] == 0).all()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name
    model.zero_grad(set_to_none=True)


def test_timed_runs_are_interleaved(model, monkeypatch):
    """Each repeat times every method once, in turn, so load that comes and goes hits them alike."""
    calls = []

    def logged(name):
        step = methods.METHODS[name][0]

        def run(m, batch, train):
            calls.append(name)
            return step(m, batch, train)

        return run

    for name in ("dense", "expand", "chunked"):
        monkeypatch.setitem(methods.METHODS, name, (logged(name), *methods.METHODS[name][1:]))
    records = run_cell(model, ["expand", "dense", "chunked"], Shape(1, 12, 4, 2), "score", repeats=3)
    assert all(r["status"] == "ok" for r in records)
    warmups, timed, memory = calls[:3], calls[3:12], calls[12:]
    assert warmups == ["dense", "expand", "chunked"]
    assert timed == ["dense", "expand", "chunked"] * 3
    assert sorted(memory) == ["chunked", "dense", "expand"]
    assert runner.METHODS is methods.METHODS


def test_a_cell_keeps_only_what_lived_before_it_out_of_the_collector():
    """Inside a cell (``long_lived_objects_frozen``) what existed before is frozen, a reference cycle the cell makes
    is still collected, and everything is unfrozen after it."""
    import gc
    import weakref

    from shared_prefix_logps.bench.memory import long_lived_objects_frozen

    class Node:
        pass

    with long_lived_objects_frozen():
        assert gc.get_freeze_count() > 0
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
    assert gc.get_freeze_count() == 0

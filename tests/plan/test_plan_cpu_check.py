"""The plan's CPU predictions against what the bench measures (peak live tensor bytes) and FlopCounterMode counts.

Grid: Qwen2 (q/k/v bias) over score/train x G in {4, 8, 16} x P in {64, 128}, Llama (no bias) over its corners
(G in {4, 16}, P = 128: the terms are the same functions of G and P, only the bias terms differ), C = 16, B = 2,
float32, at tiny widths; every method whose CPU peak can be measured (flex's cannot).
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shared_prefix_logps.bench.methods import METHODS
from shared_prefix_logps.bench.runner import Shape, make_batch
from shared_prefix_logps.plan import bench_workload, count_flops
from shared_prefix_logps.plan.check import MEASURABLE, build_model, check_grid, markdown
from shared_prefix_logps.plan.dims import dims_from_config

CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=352,
    vocab_size=4096,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
TOLERANCE = 0.15


@pytest.mark.parametrize(
    "family, prompt_lens, generations",
    [("qwen2", (64, 128), (4, 8, 16)), ("llama", (128,), (4, 16))],
    ids=["qwen2", "llama"],
)
def test_cpu_peak_within_tolerance_over_the_grid(family, prompt_lens, generations):
    records = check_grid(
        CONFIG, [family], MEASURABLE, prompts=2, prompt_lens=prompt_lens, completion_len=16, generations=generations
    )
    assert len(records) == 2 * len(prompt_lens) * len(generations) * len(MEASURABLE)
    worst = max(records, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= TOLERANCE, markdown(records)


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``self + a @ b`` (the multiply-adds of the product)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _counted_flops(model, method, shape, train):
    """FlopCounterMode's count of one step, after a first call (which checks the fused head once per model)."""
    batch = make_batch(shape, model.config.vocab_size, "cpu")
    step = METHODS[method][0]
    step(model, batch, train)
    model.zero_grad(set_to_none=True)
    # Matrix products that accumulate in place (``addmm_``: the fused head's float32 weight gradient, and the linear
    # layers' weight gradients a chunked backward multiplies into ``.grad``) have no formula of their own in
    # FlopCounterMode: counted as the ``addmm`` they are.
    in_place = {torch.ops.aten.addmm_: _addmm_flops}
    with FlopCounterMode(display=False, custom_mapping=in_place) as counter:
        step(model, batch, train)
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("method", ["dense", "expand", "chunked"])
@pytest.mark.parametrize("workload", ["score", "train"])
def test_flops_match_flop_counter(method, workload):
    model = build_model(CONFIG, "qwen2")
    w = bench_workload(2, 64, 16, 4, mode=workload, dtype="fp32")
    # FlopCounterMode has no formula for CPU's fused SDPA kernel: it counts the matmuls (body and head) only.
    dims = dims_from_config({**CONFIG, "model_type": "qwen2"})
    parts = count_flops(method, dims, w).parts
    predicted = parts["body"] + parts["head"]
    counted = _counted_flops(model, method, Shape(2, 64, 16, 4), workload == "train")
    assert abs(predicted / counted - 1) <= 0.05, (predicted, counted)


@pytest.mark.parametrize("prompts", [1, 2])
@pytest.mark.parametrize("workload", ["score", "train"])
def test_dense_half_precision_head_within_tolerance(workload, prompts):
    """bf16: ``dense`` upcasts its logits to a float32 copy (the bf16 logits freed before the log-softmax runs) and
    keeps that copy referenced through backward; with two prompts of different lengths, a group per prompt."""
    import torch

    from shared_prefix_logps.bench.runner import run_cell
    from shared_prefix_logps.plan import predicted_peak_bytes

    model = build_model(CONFIG, "qwen2").to(torch.bfloat16)
    (record,) = run_cell(model, ["dense"], Shape(prompts, 64, 16, 8), workload, repeats=0)
    w = bench_workload(prompts, 64, 16, 8, mode=workload, dtype="bf16")
    predicted = predicted_peak_bytes("dense", {**CONFIG, "model_type": "qwen2"}, w, device="cpu")
    assert abs(predicted / record["peak_bytes"] - 1) <= TOLERANCE, (predicted, record["peak_bytes"])

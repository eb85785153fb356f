"""pytest-benchmark suite: ``pytest benchmarks --benchmark-only``.

Parametrized over preset x P x C x G x method x workload. The shapes come from environment variables so the same
file serves a CPU smoke run (defaults: the tiny preset) and a GPU sweep, e.g.

    SPL_PRESET=qwen2.5-1.5b SPL_P=1024,4096 SPL_C=512 SPL_G=4,16 pytest benchmarks --benchmark-only

Each benchmark's ``extra_info`` holds the peak memory, the real token counts, the token and FLOP floors and the max
|diff| against dense.
"""

import itertools
import os

import pytest
import torch

from shared_prefix_logps.bench.memory import peak_memory
from shared_prefix_logps.bench.methods import METHODS, method_unavailable
from shared_prefix_logps.bench.presets import build_preset
from shared_prefix_logps.bench.runner import Shape, make_batch, work_counts

pytest.importorskip("pytest_benchmark")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PRESET = os.environ.get("SPL_PRESET", "tiny")
LAYERS = int(os.environ["SPL_LAYERS"]) if "SPL_LAYERS" in os.environ else (2 if PRESET == "tiny" else None)


def _ints(name, default):
    return [int(v) for v in os.environ.get(name, default).split(",")]


SHAPES = [
    Shape(_ints("SPL_B", "2")[0], p, c, g)
    for p, c, g in itertools.product(_ints("SPL_P", "64"), _ints("SPL_C", "16"), _ints("SPL_G", "2,8"))
]


@pytest.fixture(scope="module")
def model():
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    return build_preset(PRESET, dtype=dtype, device=DEVICE, layers=LAYERS)


@pytest.mark.parametrize("workload", ["score", "train"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"B{s.prompts}-P{s.prompt_len}-C{s.completion_len}-G{s.generations}"
)
def test_method(benchmark, model, shape, method, workload):
    train = workload == "train"
    reason = method_unavailable(method)
    if reason:
        pytest.skip(reason)
    step = METHODS[method][0]
    batch = make_batch(shape, model.config.vocab_size, DEVICE)
    reference = METHODS["dense"][0](model, batch, False)

    def run():
        model.zero_grad(set_to_none=True)
        step(model, batch, train)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    logps = step(model, batch, train)
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    model.zero_grad(set_to_none=True)
    if not (DEVICE.type == "cpu" and method == "flex"):
        with peak_memory(DEVICE) as mem:
            step(model, batch, train)
        benchmark.extra_info["peak_bytes"] = mem["peak_bytes"]
    model.zero_grad(set_to_none=True)
    benchmark.extra_info.update(
        preset=PRESET,
        **work_counts(model.config, batch, train),
        max_abs_diff_vs_dense=float((logps - reference).abs().max()),
    )
    tolerance = 1e-5 if next(model.parameters()).dtype == torch.float32 else 0.1
    assert benchmark.extra_info["max_abs_diff_vs_dense"] <= tolerance

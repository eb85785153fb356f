"""Smoke test of the benchmark CLI on the CPU tiny preset: every method that can run on CPU runs and agrees."""

import json

import pytest
import torch

from shared_prefix_logps.bench.methods import METHODS
from shared_prefix_logps.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_preset_runs_every_cpu_method(tmp_path, restore_threads):
    torch.set_num_threads(2)
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--prompts",
            "2",
            "--prompt-len",
            "24",
            "--completion-len",
            "6",
            "--generations",
            "2",
            "4",
            "--repeats",
            "1",
            "--methods",
            ",".join(METHODS),
            "--output",
            str(tmp_path),
            "--name",
            "smoke",
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    records = data["records"]
    assert data["meta"]["versions"]["torch"]
    assert data["meta"]["threads"] == 1 == torch.get_num_threads()  # one CPU thread unless asked otherwise
    assert "load_average" in data["meta"]
    assert len(records) == len(METHODS) * 2 * 2  # methods x G values x workloads
    by_status = {}
    for record in records:
        by_status.setdefault(record["status"], []).append(record)
        assert record["prompt_tokens"] == 24 + 12  # prompts of 24 (= P) and 12 real tokens
        assert 0 < record["token_floor"] < record["flop_floor"] < 1
        if record["status"] == "ok":
            assert record["median_ms"] > 0
            if record["method"] != "dense":
                assert record["max_abs_diff_vs_dense"] <= 1e-5, record
    assert "error" not in by_status and "OOM" not in by_status
    # Only methods whose package is missing may be skipped on CPU (flex trains there too).
    for r in by_status.get("skipped", []):
        assert r["reason"].startswith("not installed"), r
    assert (tmp_path / "smoke.md").read_text().startswith("# Benchmark: tiny")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "smoke-memory_vs_g.png").stat().st_size > 0
    assert (tmp_path / "smoke-time_vs_p.png").stat().st_size > 0


def test_unknown_method_is_refused():
    with pytest.raises(SystemExit, match="unknown method"):
        main(["bench", "--device", "cpu", "--methods", "dense,nope"])


def test_bad_sizes_and_threads_are_refused(restore_threads):
    with pytest.raises(SystemExit, match="--threads must be >= 0"):
        main(["bench", "--device", "cpu", "--threads", "-1"])
    with pytest.raises(SystemExit, match="prompt_len must be a positive int"):
        main(["bench", "--device", "cpu", "--prompt-len", "0", "--methods", "dense"])


def _config_json(tmp_path, **fields):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(fields))
    return path


TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
    max_position_embeddings=256,
)
TINY_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=101,
    max_position_embeddings=256,
)
SMALL_SHAPE = ["--prompt-len", "12", "--completion-len", "4", "--generations", "2", "--repeats", "0"]


@pytest.mark.parametrize("fields", [TINY_LLAMA, TINY_QWEN3_MOE], ids=["llama", "qwen3_moe"])
def test_a_config_json_is_benchmarked_with_its_shape(fields, tmp_path, restore_threads):
    """``--model`` takes a config.json (or its directory), as ``plan`` does; ``--layers`` keeps its first layers."""
    from shared_prefix_logps.bench import presets

    built = []
    build = presets.build_model

    def spy(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    path = _config_json(tmp_path, **fields)
    argv = ["bench", "--device", "cpu", "--model", str(path), "--layers", "2", "--methods", "dense,expand"]
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(presets, "build_model", spy)
        assert main([*argv, *SMALL_SHAPE, "--workloads", "score", "--output", str(out)]) == 0
    (model,) = built
    assert (
        type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[fields["model_type"]]
    )
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["preset"] == str(path) and data["meta"]["layers"] == 2
    assert [r["status"] for r in data["records"]] == ["ok", "ok"]
    assert data["records"][1]["max_abs_diff_vs_dense"] <= 1e-5


def test_preset_is_an_alias_of_model(tmp_path, restore_threads):
    for option in ("--model", "--preset"):
        out = tmp_path / option.strip("-")
        argv = ["bench", "--device", "cpu", option, "tiny", "--layers", "1", "--methods", "dense", "--workloads"]
        assert main([*argv, "score", *SMALL_SHAPE, "--output", str(out)]) == 0
        assert json.loads((out / "bench.json").read_text())["meta"]["preset"] == "tiny"


@pytest.mark.parametrize(
    "model, layers, message",
    [
        ("no-such-preset", None, "--model: unknown preset 'no-such-preset' and no config.json there"),
        ("directory-without-config", None, "--model: unknown preset"),
        ("broken", None, "is not a readable JSON config"),
        ("gemma3", "9", "--layers: layers=9"),
    ],
)
def test_bad_model_or_layers_are_named(model, layers, message, tmp_path):
    (tmp_path / "directory-without-config").mkdir()
    (tmp_path / "broken.json").write_text("{not json")
    gemma3 = dict(TINY_LLAMA, model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"] * 2)
    paths = {
        "directory-without-config": tmp_path / "directory-without-config",
        "broken": tmp_path / "broken.json",
        "gemma3": _config_json(tmp_path, **gemma3) / "config.json",
    }
    argv = ["bench", "--device", "cpu", "--model", str(paths.get(model, model)), "--methods", "dense"]
    with pytest.raises(SystemExit) as raised:
        main([*argv, *(["--layers", layers] if layers else []), *SMALL_SHAPE])
    assert message in str(raised.value), raised.value


def test_no_method_is_refused():
    with pytest.raises(SystemExit, match="--methods: no method given"):
        main(["bench", "--device", "cpu", "--methods", ","])

"""``shared-prefix-logps plan``: the table, the JSON records, and bad input named by its option."""

import json

import pytest

from shared_prefix_logps.cli import main
from shared_prefix_logps.plan import Engine, Workload, parse_memory_size, plan

BASE = ["plan", "--model", "qwen2.5-7b", "--prompt-len", "4096", "--completion-len", "1024", "--generations", "16"]


def test_json_has_one_record_per_method_with_peak_flops_and_breakdown(capsys):
    assert main([*BASE, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["methods"]
    assert [r["method"] for r in records] == ["dense", "trl", "expand", "flex", "chunked"]
    for record in records:
        assert record["peak_bytes"] == sum(record["breakdown"].values())
        assert record["flops"] == sum(record["flops_breakdown"].values()) > 0
    by_method = {r["method"]: r for r in records}
    # Sharing the prompt forwards 4096 + 16 x 1024 tokens instead of 16 x 5120: fewer activations and FLOPs.
    assert by_method["expand"]["peak_bytes"] < by_method["dense"]["peak_bytes"]
    assert by_method["chunked"]["peak_bytes"] < by_method["expand"]["peak_bytes"]
    assert by_method["expand"]["flops"] < by_method["dense"]["flops"] / 3


def test_table_prints_every_method_and_max_generations(capsys):
    assert main([*BASE, "--gpus", "8", "--engine", "fsdp2", "--max-generations"]) == 0
    out = capsys.readouterr().out
    for method in ("dense", "trl", "expand", "flex", "chunked"):
        assert f"| {method} |" in out
    assert "max G" in out and "token floor 0.250" in out


def test_fsdp2_shards_model_state_but_not_activations():
    w = Workload(1, 1024, 256, 8)
    single = plan("qwen2.5-7b", w, Engine(), ["expand"])[0].memory.terms
    sharded = plan("qwen2.5-7b", w, Engine("fsdp2", 8), ["expand"])[0].memory.terms
    assert sharded["parameters"] == single["parameters"] // 8
    assert sharded["optimizer states"] == single["optimizer states"] // 8
    assert sharded["completion activations"] == single["completion activations"]


def test_gradient_checkpointing_cuts_activations():
    plain = plan("qwen2.5-7b", Workload(1, 4096, 1024, 16), methods=["chunked"])[0].memory
    checkpointed = Workload(1, 4096, 1024, 16, gradient_checkpointing=True)
    cut = plan("qwen2.5-7b", checkpointed, methods=["chunked"])[0].memory
    # A layer keeps its input (H x s per token) instead of about 40 H-sized tensors' worth.
    assert cut.terms["prompt activations"] * 20 < plain.terms["prompt activations"]
    assert cut.peak_bytes < plain.peak_bytes


@pytest.mark.parametrize(
    "args, option",
    [
        (["--model", "no-such-model"], "--model"),
        (["--prompt-len", "-5"], "--prompt-len"),
        (["--completion-len", "0"], "--completion-len"),
        (["--generations", "0"], "--generations"),
        (["--gpu-memory", "lots"], "--gpu-memory"),
        (["--workload", "serve"], "--workload"),
        (["--methods", "dense,magic"], "--methods"),
    ],
)
def test_bad_input_names_the_option(args, option):
    argv = list(BASE)
    for i in range(0, len(args), 2):
        if args[i] in argv:
            argv[argv.index(args[i]) + 1] = args[i + 1]
        else:
            argv += args[i : i + 2]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert str(raised.value).startswith(f"shared-prefix-logps plan: {option}:"), str(raised.value)


def test_config_without_needed_fields_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(SystemExit) as raised:
        main(["plan", "--model", str(path), "--prompt-len", "8", "--completion-len", "4", "--generations", "2"])
    message = str(raised.value)
    assert "--model" in message and "num_hidden_layers" in message and "vocab_size" in message


@pytest.mark.parametrize(
    "text, size", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512MiB", 2**29), ("1024B", 1024), ("141 gb", 141e9)]
)
def test_memory_sizes(text, size):
    assert parse_memory_size(text) == size


def test_a_memory_size_needs_its_unit():
    """``--gpu-memory 80`` meant 80 GB; read as bytes it made every method "not fit"."""
    with pytest.raises(ValueError, match="has no unit"):
        parse_memory_size("80")
    with pytest.raises(SystemExit) as raised:
        main([*BASE, "--gpu-memory", "80"])
    assert str(raised.value).startswith("shared-prefix-logps plan: --gpu-memory: '80' has no unit"), raised.value


@pytest.mark.parametrize("methods", ["", ",", " , "])
def test_no_method_is_refused(methods, capsys):
    with pytest.raises(SystemExit) as raised:
        main([*BASE, "--methods", methods])
    assert str(raised.value).startswith("shared-prefix-logps plan: --methods: no method given"), raised.value
    assert "| method |" not in capsys.readouterr().out


def test_settings_name_the_largest_chunk_that_fits(capsys):
    args = ["--prompt-len", "16384", "--generations", "64", "--prompts", "1", "--gradient-checkpointing"]
    assert main([*BASE[:3], "--completion-len", "1024", *args, "--lora-fraction", "0.01", "--methods", "chunked"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("settings: chunked_backward(generations_per_chunk=") and line.endswith("fits")
    chunk = int(line.split("=")[1].split(")")[0])
    # The named chunk fits and twice it does not (or it is all of G).
    w = Workload(1, 16384, 1024, 64, gradient_checkpointing=True, lora_fraction=0.01)
    engine = Engine(memory_bytes=parse_memory_size("80GB"))
    assert plan("qwen2.5-7b", w.with_chunk(chunk), engine, ["chunked"])[0].fits
    assert chunk == 64 or not plan("qwen2.5-7b", w.with_chunk(2 * chunk), engine, ["chunked"])[0].fits


def test_lora_freezes_the_head():
    full = plan("qwen2.5-7b", Workload(1, 1024, 256, 8), methods=["expand"])[0].memory.terms
    lora = plan("qwen2.5-7b", Workload(1, 1024, 256, 8, lora_fraction=0.01), methods=["expand"])[0].memory.terms
    assert full["head weight grad (fp32)"] == 4 * 152064 * 3584
    assert "head weight grad (fp32)" not in lora
    assert lora["gradients"] < full["gradients"] / 50


def test_bad_generations_per_chunk_names_the_option():
    with pytest.raises(SystemExit) as raised:
        main([*BASE, "--generations-per-chunk", "32"])
    assert "--generations-per-chunk" in str(raised.value) and "[1, G=16]" in str(raised.value)


def test_step_only_prediction_leaves_out_the_model_state():
    from shared_prefix_logps.plan import predicted_peak_bytes

    w = Workload(2, 1024, 256, 8)
    whole = plan("qwen2.5-1.5b", w, methods=["expand"])[0].memory
    step = predicted_peak_bytes("expand", "qwen2.5-1.5b", w, step_only=True)
    assert step == whole.peak_bytes - whole.terms["parameters"] - whole.terms["optimizer states"]
    assert predicted_peak_bytes("expand", "qwen2.5-1.5b", w) == whole.peak_bytes


#: bench's own batch at this shape (``bench.runner.make_batch``): prompts of P down to P/2 real tokens, completions of
#: C/2 to C.
RAGGED = dict(prompts=2, prompt_len=512, completion_len=256, generations=16)


def _ragged_argv(*extra):
    shape = RAGGED
    return [
        "plan",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--json",
        "--prompts",
        str(shape["prompts"]),
        "--prompt-len",
        str(shape["prompt_len"]),
        "--completion-len",
        str(shape["completion_len"]),
        "--generations",
        str(shape["generations"]),
        *extra,
    ]


@pytest.mark.parametrize("workload", ["score", "train"])
def test_ragged_batch_token_counts_reach_the_plan(workload, capsys):
    """With the bench batch's real token counts the CLI predicts what ``bench_workload`` (which the CPU check holds
    against bench's measurements) predicts; with padded widths only it over-predicts (dense scoring by 1.9x here)."""
    from shared_prefix_logps.plan import bench_workload

    expected = bench_workload(*RAGGED.values(), mode=workload, dtype="fp32")
    counts = ["--prompt-tokens", str(expected.prompt_tokens), "--completion-tokens", str(expected.scored_tokens)]
    assert main([*_ragged_argv("--workload", workload), *counts]) == 0
    ragged = {r["method"]: r["peak_bytes"] for r in json.loads(capsys.readouterr().out)["methods"]}
    engine = Engine(device="cpu")
    assert ragged == {p.memory.method: p.memory.peak_bytes for p in plan("tiny", expected, engine)}
    assert main(_ragged_argv("--workload", workload)) == 0
    padded = {r["method"]: r["peak_bytes"] for r in json.loads(capsys.readouterr().out)["methods"]}
    assert all(padded[m] >= ragged[m] for m in padded)
    if workload == "score":
        assert padded["dense"] > 1.5 * ragged["dense"]
    # Mean lengths are the same counts per prompt and per completion.
    means = [
        "--mean-prompt-len",
        str(expected.prompt_tokens / RAGGED["prompts"]),
        "--mean-completion-len",
        str(expected.scored_tokens / (RAGGED["prompts"] * RAGGED["generations"])),
    ]
    assert main([*_ragged_argv("--workload", workload), *means]) == 0
    assert {r["method"]: r["peak_bytes"] for r in json.loads(capsys.readouterr().out)["methods"]} == ragged


@pytest.mark.parametrize(
    "extra, option",
    [
        (["--prompt-tokens", "1"], "--prompt-tokens"),  # fewer than one token per prompt
        (["--prompt-tokens", "5000"], "--prompt-tokens"),  # more than B x P
        (["--completion-tokens", "9000"], "--completion-tokens"),
        (["--prompt-tokens", "600", "--mean-prompt-len", "300"], "--prompt-tokens"),
        (["--mean-completion-len", "0"], "--mean-completion-len"),
    ],
)
def test_bad_token_counts_are_named(extra, option):
    with pytest.raises(SystemExit) as raised:
        main([*_ragged_argv(), *extra])
    assert str(raised.value).startswith(f"shared-prefix-logps plan: {option}:"), str(raised.value)

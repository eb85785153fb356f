"""The verl tokens-forwarded benchmark at a tiny size: it runs, the patched engine embeds fewer tokens than verl's
own on the prompt-heavy batch, and its log-probs agree."""

import pytest

pytest.importorskip("verl")

import bench_verl  # noqa: E402


def test_verl_benchmark_tiny(tmp_path):
    args = ["--prompts", "2", "--responses", "4", "--prompt-len", "48", "--response-len", "6"]
    records = bench_verl.main(args + ["--micro-batch", "4", "--repeats", "1", "--output", str(tmp_path / "r.json")])
    by_key = {(r["workload"], r["engine"]): r for r in records}
    for workload in ("old_log_prob", "update_actor"):
        ours, verl = by_key[workload, "shared_prefix"], by_key[workload, "verl"]
        assert ours["embedded_tokens"] < 0.6 * verl["embedded_tokens"], (ours, verl)
        assert ours["real_tokens"] < ours["dense_real_tokens"]
        assert ours["max_abs_diff_vs_verl"] < 1e-5
    assert (tmp_path / "r.json").exists()

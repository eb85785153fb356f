"""Re-measure the tiny-node rule's threshold (``tree.merge.MERGE_BELOW_SAVED_TOKENS``): the fixed cost of one node
call in forwarded-token equivalents, on this machine.

The workload: a shared prompt of ``prompt`` tokens with two children, a leaf of ``leaf`` tokens and a fork node of
``m`` tokens above ``leaves`` leaves of ``leaf`` tokens. Unmerged, the fork node is one more node call (one more trie
depth); merged, its ``m`` tokens are forwarded once per leaf, ``m * (leaves - 1)`` more tokens. The time saved by
merging is then ``call_cost - token_cost * m * (leaves - 1)``: a line in the extra tokens, fitted by least squares
over several ``m``; its intercept over its slope is the break-even, the tokens a node call costs.

Run ``python -m shared_prefix_logps.bench.node_cost`` (add ``--help`` for the sizes).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..engine.plan import rows_plan
from ..engine.run import score_plan
from ..forward.context import CallSettings
from ..inputs import check_tree_rows
from ..model import prepare_model


def fork_rows(m: int, *, prompt: int, leaf: int, leaves: int, vocab: int, seed: int = 0):
    """(ids, attention_mask, score_mask), each (leaves + 1, prompt + m + leaf) unpadded but for the short row (right
    padding): the measurement's workload (see the module)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, vocab, (prompt,), generator=gen)
    fork = torch.randint(1, vocab, (m,), generator=gen)
    width = prompt + m + leaf
    ids = torch.zeros(leaves + 1, width, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i in range(leaves):
        tail = torch.randint(1, vocab, (leaf,), generator=gen)
        ids[i] = torch.cat([shared, fork, tail])
        mask[i] = True
    ids[leaves, : prompt + leaf] = torch.cat([shared, torch.randint(1, vocab, (leaf,), generator=gen)])
    ids[leaves, prompt] = 0 if int(fork[0]) != 0 else 1  # the short row leaves the shared prompt at once
    mask[leaves, : prompt + leaf] = True
    score = mask.clone()
    score[:, 0] = False
    return ids, mask, score


def _seconds(prepared, rows, thresholds: tuple[int, int], grad: bool, repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` tree calls (forward, and backward of the log-probs' sum with ``grad``) under each
    of the two merge thresholds, the two timed in turn so that both see the same load on the machine."""
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, merge_below in enumerate(thresholds):
            prepared.causal_lm.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.set_grad_enabled(grad):
                plan = rows_plan(rows, merge_below)
                out = score_plan(prepared, plan, CallSettings("expand"))
                if grad:
                    out.logps.sum().backward()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def measure_node_call_cost(
    model,
    *,
    fork_lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    prompt: int = 64,
    leaf: int = 32,
    leaves: int = 4,
    grad: bool = True,
    repeats: int = 7,
) -> dict:
    """The fixed cost of a node call in token-equivalents on ``model`` (see the module).

    Returns:
        ``tokens`` (the break-even: call cost over token cost), ``call_ms``, ``token_ms`` and, per fork length,
        ``(extra tokens if merged, unmerged seconds, merged seconds)`` in ``points``.
    """
    prepared = prepare_model(model)
    vocab = prepared.input_vocab_size
    workloads = []
    for m in fork_lengths:
        ids, mask, score = fork_rows(m, prompt=prompt, leaf=leaf, leaves=leaves, vocab=vocab)
        # A threshold just above the fork node's saving merges it and nothing else (the prompt saves far more).
        extra = m * (leaves - 1)
        workloads.append((extra, check_tree_rows(ids, mask, score, model=prepared)))
    for extra, rows in workloads:  # warm-up: one-time work (the head check, kernel choices) out of the timings
        _seconds(prepared, rows, (0, extra + 1), grad, 1)
    points = []
    for extra, rows in workloads:
        unmerged, merged = _seconds(prepared, rows, (0, extra + 1), grad, repeats)
        points.append((extra, unmerged, merged))
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    saved = torch.tensor([p[1] - p[2] for p in points], dtype=torch.float64)
    slope, intercept = _line(x, saved)
    token_cost = -slope
    return dict(
        tokens=float(intercept / token_cost) if token_cost > 0 else float("inf"),
        call_ms=1e3 * float(intercept),
        token_ms=1e3 * float(token_cost),
        points=points,
    )


def _line(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ``y`` against ``x``."""
    design = torch.stack([x, torch.ones_like(x)], dim=1)
    solution = torch.linalg.lstsq(design, y[:, None]).solution.squeeze(1)
    return float(solution[0]), float(solution[1])


def _qwen2(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure a tree node call's fixed cost in forwarded tokens (CPU).")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = _qwen2(args.hidden, args.layers, args.vocab)
    for grad in (True, False):
        result = measure_node_call_cost(model, grad=grad, repeats=args.repeats)
        label = "with gradients" if grad else "without gradients"
        print(
            f"{label}: a node call costs {result['tokens']:.1f} tokens "
            f"(call {result['call_ms']:.2f} ms, token {result['token_ms']:.4f} ms)"
        )
        for extra, unmerged, merged in result["points"]:
            times = f"unmerged {1e3 * unmerged:8.2f} ms, merged {1e3 * merged:8.2f} ms"
            print(f"  extra tokens if merged {extra:4d}: {times}")


if __name__ == "__main__":
    main()

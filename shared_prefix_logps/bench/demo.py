"""The main job in one command: shared-prefix vs dense log-probs on a GRPO-shaped batch.

``python -m shared_prefix_logps.bench.demo`` (``make demo``) builds a random model from a config (nothing downloaded),
makes a batch of left-padded prompts of different lengths with G right-padded completions each, and runs a
training-shaped step (forward + backward of a log-prob loss) both ways. It prints the largest log-prob difference, the
real tokens each path forwards (pads are not counted), the token and FLOP floors, and the wall-time and peak-memory
ratios. On CPU it uses the ``tiny`` preset and one thread; with CUDA a bigger one.
"""

from __future__ import annotations

import argparse
import statistics
import time

from .presets import PRESETS

# torch and the benchmark's modules are imported where the demo runs: `demo --help` answers without them.


def _step(model, batch, backend):
    """One training-shaped step (forward, then backward of the summed log-probs); the detached log-probs. ``dense``
    is the benchmark's dense method (full rows on the real prompt tokens)."""
    from .methods import METHODS, compute_logps_step

    step = METHODS["dense"][0] if backend == "dense" else compute_logps_step(backend)
    return step(model, batch, True)


def _timed(model, batch, repeats, device) -> tuple[float, float]:
    """Median seconds of a dense and a shared step, run alternately so background load hits both alike."""
    import torch

    times = {"dense": [], "auto": []}
    for i in range(repeats + 1):  # the first round warms up
        for backend in ("dense", "auto"):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, batch, backend)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times[backend].append(time.perf_counter() - start)
    return statistics.median(times["dense"]), statistics.median(times["auto"])


def _peak(model, batch, backend, device):
    from .memory import peak_memory

    model.zero_grad(set_to_none=True)
    with peak_memory(device) as mem:
        _step(model, batch, backend)
    return mem["peak_bytes"]


#: Demo defaults that depend on whether CUDA is there: option -> (with CUDA, without).
DEMO_CUDA_DEFAULTS = {
    "preset": ("qwen2.5-0.5b", "tiny"),
    "prompt_len": (1024, 256),
    "completion_len": (128, 32),
    "device": ("cuda", "cpu"),
}


def build_parser() -> argparse.ArgumentParser:
    """The demo's options (``make demo``, ``shared-prefix-logps demo``)."""
    parser = argparse.ArgumentParser(prog="shared-prefix-logps demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model shape, built from a config with random weights (default: qwen2.5-0.5b with CUDA, tiny without)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="B, prompts per batch (default: %(default)s)")
    parser.add_argument("--generations", type=int, default=8, help="G, completions per prompt (default: %(default)s)")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="P, the longest prompt (default: 1024 with CUDA, 256 without)"
    )
    parser.add_argument(
        "--completion-len", type=int, default=None, help="C, completion width (default: 128 with CUDA, 32 without)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats; the median is kept (default: %(default)s)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where it is available)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: 1 on CPU, torch's with CUDA; 0: torch's)"
    )
    return parser


def main(argv=None) -> dict:
    """Run the demo; returns the figures it printed."""
    parser = build_parser()
    args = parser.parse_args(argv)

    import torch

    from .presets import build_preset
    from .run_info import fill_cuda_defaults, set_cpu_threads
    from .runner import Shape, make_batch, work_counts

    fill_cuda_defaults(args, DEMO_CUDA_DEFAULTS)
    device = torch.device(args.device)
    try:
        set_cpu_threads(args.threads, device)
    except ValueError as error:
        parser.error(f"--{error}")

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_preset(args.preset, dtype=dtype, device=device)
    model.train()
    vocab = model.config.vocab_size
    # Prompts of real lengths P down to P/2 (left-padded), completions of C/2..C tokens (right-padded).
    try:
        shape = Shape(args.prompts, args.prompt_len, args.completion_len, args.generations)
    except ValueError as error:
        parser.error(str(error))
    batch = make_batch(shape, vocab, device)
    counts = work_counts(model.config, batch, train=True)
    prompt_tokens, completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
    dense_tokens, shared_tokens = counts["dense_tokens"], counts["shared_tokens"]
    floor, flop_floor = counts["token_floor"], counts["flop_floor"]
    g = args.generations

    print(f"model: {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}) on {device}")
    print(
        f"batch: {args.prompts} prompts x G={g}, P={args.prompt_len} (left-padded, {prompt_tokens} real tokens), "
        f"C={args.completion_len} (right-padded, {completion_tokens} real tokens)"
    )
    shared = _step(model, batch, "auto")
    dense = _step(model, batch, "dense")
    max_diff = (shared - dense).abs().max().item()
    t_dense, t_shared = _timed(model, batch, args.repeats, device)
    m_dense = _peak(model, batch, "dense", device)
    m_shared = _peak(model, batch, "auto", device)
    figures = dict(
        max_abs_diff=max_diff,
        dense_tokens=dense_tokens,
        shared_tokens=shared_tokens,
        token_floor=floor,
        flop_floor=flop_floor,
        dense_seconds=t_dense,
        shared_seconds=t_shared,
        speedup=t_dense / t_shared,
        dense_peak_bytes=m_dense,
        shared_peak_bytes=m_shared,
        memory_ratio=m_shared / m_dense,
    )
    print(f"max |shared - dense| log-prob: {max_diff:.3g}")
    print(
        f"real tokens forwarded: dense {dense_tokens:,}  shared {shared_tokens:,}  (token floor {floor:.3f}, "
        f"FLOP floor {flop_floor:.3f})"
    )
    print(
        f"forward+backward, median of {args.repeats}: dense {t_dense * 1e3:.0f} ms  shared {t_shared * 1e3:.0f} ms  "
        f"-> {figures['speedup']:.2f}x faster (the FLOP floor allows {1 / flop_floor:.2f}x)"
    )
    what = "CUDA max_memory_allocated" if device.type == "cuda" else "peak live tensor bytes"
    print(
        f"peak memory ({what}): dense {m_dense / 2**20:.1f} MiB  shared {m_shared / 2**20:.1f} MiB  "
        f"-> ratio {figures['memory_ratio']:.3f}"
    )
    return figures


if __name__ == "__main__":
    main()

"""Microbenchmark: log-softmax-gather kernel and fused chunked head against torch and other projects' heads.

    python benchmarks/bench_kernels.py                       # N=8192, V=151936, H=4096, bf16
    python benchmarks/bench_kernels.py --n 4096 --only head

CUDA only. For each case: median time over ``--iters`` runs (CUDA events), the peak memory the case added on top of
its inputs, and two roofline-style rates:
  * GB/s with the logits traffic counted as 2*N*V bytes per pass over bf16 logits (forward: one pass; forward +
    backward: three passes: read in forward, read and write d logits in backward),
  * TFLOP/s with the head's useful matmul work counted as 2*N*H*V (x3 for forward + backward; recomputation in
    backward is not credited).
Optional competitors (Liger, cut-cross-entropy, TRL, torch's linear_cross_entropy) run when importable; a missing
one is reported, never an error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192, help="tokens")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--chunk-size", type=int, default=None, help="head rows per chunk (default: what linear_logps picks on CUDA)"
    )
    p.add_argument("--only", choices=["kernel", "head", "all"], default="all")
    return p.parse_args(argv)


def _time_case(fn: Callable[[], object], iters: int, warmup: int) -> tuple[float, int]:
    """(median milliseconds, peak bytes allocated above what existed before the case)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _report(name: str, ms: float, peak: int, *, bytes_moved: float | None = None, flops: float | None = None):
    rate = []
    if bytes_moved is not None:
        rate.append(f"{bytes_moved / ms / 1e6:8.1f} GB/s")
    if flops is not None:
        rate.append(f"{flops / ms / 1e9:7.1f} TFLOP/s")
    print(f"  {name:<46} {ms:9.3f} ms  peak +{peak / 2**30:7.3f} GiB  {'  '.join(rate)}", flush=True)


def _run(name: str, fn: Callable[[], object], args, **rates) -> None:
    try:
        ms, peak = _time_case(fn, args.iters, args.warmup)
    except Exception as exc:  # a competitor's version mismatch or OOM must not end the run
        print(f"  {name:<46} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
        torch.cuda.empty_cache()
        return
    _report(name, ms, peak, **rates)
    torch.cuda.empty_cache()


def _optional(label: str, loader: Callable[[], object]):
    try:
        return loader()
    except Exception as exc:
        print(f"  {label:<46} unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})", flush=True)
        return None


def bench_kernel(args, dtype) -> None:
    from shared_prefix_logps.kernels import logsoftmax_gather

    n, v = args.n, args.vocab
    print(f"\nlogsoftmax_gather: logits ({n}, {v}) {dtype}")
    logits = torch.randn(n, v, device="cuda", dtype=dtype) * 4
    targets = torch.randint(0, v, (n,), device="cuda")
    fwd_bytes = n * v * logits.element_size()  # 2*N*V for bf16: one read of the logits
    fwdbwd_bytes = 3 * fwd_bytes  # + backward's read of the logits and write of d logits

    def torch_logps(x):
        return x.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)

    with torch.no_grad():
        ref = torch_logps(logits)
        ours = logsoftmax_gather(logits, targets, implementation="triton")
        print(f"  max |ours - torch| = {(ours - ref).abs().max().item():.3e}   max ours = {ours.max().item():.3e}")
        _run("ours fwd", lambda: logsoftmax_gather(logits, targets), args, bytes_moved=fwd_bytes)
        _run(
            "ours fwd (+entropy)",
            lambda: logsoftmax_gather(logits, targets, return_entropy=True),
            args,
            bytes_moved=fwd_bytes,
        )
        _run("torch log_softmax+gather fwd", lambda: torch_logps(logits), args, bytes_moved=fwd_bytes)

    leaf = logits.detach().requires_grad_()

    def ours_fwd_bwd():
        logsoftmax_gather(leaf, targets).sum().backward()
        leaf.grad = None

    def ours_fwd_bwd_inplace():
        x = leaf * 1  # a temporary the op may overwrite, as the head's chunk logits are; the copy is timed too
        logsoftmax_gather(x, targets, inplace_backward=True).sum().backward()
        leaf.grad = None

    def torch_fwd_bwd():
        torch_logps(leaf).sum().backward()
        leaf.grad = None

    _run("ours fwd+bwd", ours_fwd_bwd, args, bytes_moved=fwdbwd_bytes)
    _run("ours fwd+bwd in place (incl. a logits copy)", ours_fwd_bwd_inplace, args, bytes_moved=fwdbwd_bytes)
    _run("torch log_softmax+gather fwd+bwd", torch_fwd_bwd, args, bytes_moved=fwdbwd_bytes)

    trl = _optional("TRL selective_log_softmax", lambda: __import__("trl.trainer.utils", fromlist=["x"]))
    if trl is not None and hasattr(trl, "selective_log_softmax"):
        with torch.no_grad():
            _run(
                "TRL selective_log_softmax fwd",
                lambda: trl.selective_log_softmax(logits, targets),
                args,
                bytes_moved=fwd_bytes,
            )


def _torch_chunked_head(hidden, weight, targets, chunk):
    """Conventional chunked head: each chunk checkpointed so only one chunk's logits live at a time."""
    from torch.utils.checkpoint import checkpoint

    def one(h, t):
        return (h @ weight.t()).float().log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)

    outs = [
        checkpoint(one, hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
        for s in range(0, hidden.shape[0], chunk)
    ]
    return torch.cat(outs)


def head_chunk_rows(
    n: int, vocab: int, device: torch.device, requested: int | None = None, dtype: torch.dtype = torch.float32
) -> tuple[int, str]:
    """(rows per chunk of the fused head, how they were chosen): ``--chunk-size`` if given, else the size
    ``linear_logps`` itself picks for ``n`` rows of ``dtype`` without a softcap on ``device`` (on CUDA from the
    memory available now, so call it with the inputs allocated)."""
    from shared_prefix_logps.kernels.fused_head import chunk_logit_bytes, cuda_available_bytes, default_chunk_size

    if requested:
        return requested, "--chunk-size"
    rows = default_chunk_size(n, vocab, device=device, logit_bytes=chunk_logit_bytes(dtype, None))
    if device.type != "cuda":
        return rows, f"default on {device.type}"
    available = cuda_available_bytes(device)
    return rows, f"default on cuda: an eighth of {available / 2**30:.1f} GiB available, within [0.5, 8] GiB"


def bench_head(args, dtype) -> None:
    from shared_prefix_logps.kernels.fused_head import linear_logps

    n, v, h = args.n, args.vocab, args.hidden
    hidden = (torch.randn(n, h, device="cuda") / h**0.5).to(dtype).requires_grad_()
    weight = torch.randn(v, h, device="cuda").to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    # The size linear_logps picks by itself in a training step, the inputs already allocated (not the CPU budget).
    chunk, chosen = head_chunk_rows(n, v, hidden.device, args.chunk_size, hidden.dtype)
    print(f"\nlinear_logps: hidden ({n}, {h}), weight ({v}, {h}) {dtype}, chunk {chunk} rows ({chosen})")
    fwd_flops, fwdbwd_flops = 2 * n * h * v, 6 * n * h * v

    def fwd(fn):
        def step():
            with torch.no_grad():
                fn()

        return step

    def fwd_bwd(fn):
        def step():
            fn().float().sum().backward()
            hidden.grad = weight.grad = None

        return step

    with torch.no_grad():
        ours = linear_logps(hidden, weight, targets, chunk_size=chunk)
        ref = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        print(f"  max |ours - dense bf16 torch| = {(ours - ref).abs().max().item():.3e}")
        del ref

    cases = {
        "ours (triton)": lambda: linear_logps(hidden, weight, targets, chunk_size=chunk),
        "ours (+entropy)": lambda: linear_logps(hidden, weight, targets, chunk_size=chunk, return_entropy=True)[0],
        "ours (torch statistics)": lambda: linear_logps(
            hidden, weight, targets, chunk_size=chunk, implementation="torch"
        ),
        "torch chunked + checkpoint": lambda: _torch_chunked_head(hidden, weight, targets, chunk),
        "torch dense (full logits)": lambda: (
            (hidden @ weight.t()).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        ),
    }

    lce = getattr(torch.nn.functional, "linear_cross_entropy", None)
    opts = _optional("torch linear_cross_entropy", lambda: torch.nn.LinearCrossEntropyOptions)
    if lce is not None and opts is not None:
        cases["torch linear_cross_entropy (chunked)"] = lambda: (
            -lce(hidden, weight, targets, reduction="none", options=opts())
        )

    liger = _optional("Liger fused linear CE", lambda: __import__("liger_kernel.transformers", fromlist=["x"]))
    if liger is not None:
        liger_loss = liger.LigerFusedLinearCrossEntropyLoss(reduction="none")
        cases["Liger fused linear CE (reduction none)"] = lambda: -liger_loss(weight, hidden, targets)

    cce = _optional("cut-cross-entropy", lambda: __import__("cut_cross_entropy", fromlist=["x"]))
    if cce is not None:
        cases["cut-cross-entropy (reduction none)"] = lambda: (
            -cce.linear_cross_entropy(hidden, weight, targets, reduction="none")
        )

    for name, fn in cases.items():
        _run(f"{name} fwd", fwd(fn), args, flops=fwd_flops)
    for name, fn in cases.items():
        _run(f"{name} fwd+bwd", fwd_bwd(fn), args, flops=fwdbwd_flops)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_kernels.py: no CUDA device found; this benchmark times GPU kernels only and was skipped. "
            "(Correctness on CPU is covered by tests/kernels/test_logsoftmax_gather.py and "
            "tests/kernels/test_linear_logps.py.)",
            file=sys.stderr,
        )
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    torch.manual_seed(0)
    if args.only in ("kernel", "all"):
        bench_kernel(args, dtype)
    if args.only in ("head", "all"):
        bench_head(args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())

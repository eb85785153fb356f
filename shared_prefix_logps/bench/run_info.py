"""What a benchmark run records about itself and how it reports progress: package versions, the commit, the device,
the CPU threads and load average, the metadata of a results file, and the progress bar of long runs."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def package_versions() -> dict:
    import transformers

    import shared_prefix_logps

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shared_prefix_logps": shared_prefix_logps.__version__,
    }
    for name in ("triton", "trl", "peft"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    return versions


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def run_meta(args, dtype: torch.dtype, device: torch.device, load_before: list[float] | None, **extra) -> dict:
    """What a results file records about its run: preset (the ``--model`` given: a preset name or a config path),
    dtype, device, versions, commit, threads, the load average before (``load_before``) and now, and ``extra``."""
    return dict(
        preset=args.model,
        layers=args.layers,
        dtype=str(dtype),
        device=device_name(device),
        versions=package_versions(),
        commit=git_commit(),
        threads=torch.get_num_threads() if device.type == "cpu" else None,
        load_average=dict(before=load_before, after=load_average()),
        **extra,
    )


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, where the platform has them."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def set_cpu_threads(threads: int | None, device: torch.device) -> None:
    """``threads`` CPU threads for torch; by default one on CPU (a loaded machine stalls many threads at every
    barrier of the shared path's many small ops, so torch's default measures the load more than the code), and
    torch's own setting where the work runs on CUDA. ``0`` keeps torch's default."""
    if threads is None:
        threads = 1 if device.type == "cpu" else 0
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)


def progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, file=sys.stderr)

        def update(text):
            bar.set_postfix_str(text)
            bar.update(1)

        return update
    done = [0]

    def update(text):
        done[0] += 1
        print(f"[{done[0]}/{total}] {text}", file=sys.stderr, flush=True)

    return update


def fill_cuda_defaults(args, defaults: dict) -> None:
    """Fill the options left unset (None) in ``args`` from ``defaults`` (option -> (with CUDA, without))."""
    unset = [name for name in defaults if getattr(args, name) is None]
    if unset:
        import torch

        cuda = torch.cuda.is_available()
        for name in unset:
            setattr(args, name, defaults[name][0 if cuda else 1])


def build_bench_model(args, dtype, device):
    """The model ``bench`` runs (``--model``: a preset or a config.json, ``--layers``), in eval mode; a bad
    ``--model`` or ``--layers`` exits naming the option."""
    from .presets import build_model

    try:
        model = build_model(args.model, dtype=dtype, device=device, layers=args.layers)
    except ValueError as error:
        option = "--layers" if str(error).startswith("layers") else "--model"
        raise SystemExit(f"{option}: {error}") from None
    model.train(False)
    return model

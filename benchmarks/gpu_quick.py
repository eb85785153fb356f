"""The GPU quick run's stages (``benchmarks/gpu_quick.sh`` calls this file): exactness, speed and memory evidence from
one short call on a CUDA machine, streamed to ``$OUT`` as it is measured.

    python benchmarks/gpu_quick.py run --out OUT --deadline-s 480     # every stage, one after the other
    python benchmarks/gpu_quick.py stage S2 --out OUT --until EPOCH    # one stage (what ``run`` starts per stage)

``run`` (no torch import) starts each stage in a process of its own, bounded by the time left before one global
deadline: a stage whose estimated cost exceeds what is left is skipped with that reason, a stage that overruns is
stopped (its results so far are already on disk). Inside a stage each check is skipped the same way when its own
estimate no longer fits. Every result is one JSON line appended to ``OUT/results.jsonl`` the moment it exists::

    {"stage": "S1", "name": "fp32 flex train", "status": "ok" | "failed" | "skipped", ...figures}

Each stage ends with a ``"stage"`` line: ``ok``, ``failed`` (a check failed, or the stage's process ended with an
error), ``skipped``, or ``stopped`` (cut at the end of its share of the deadline, listing what it had measured). The
run exits 1 when a check failed, 0 otherwise: a stage the deadline stopped is not a failed check.

Stages, in order of evidence (docs/benchmarks.md has the table with estimated H100 times):

- S0 environment: versions, GPU, cuDNN, torch's SDPA priority order, a Triton trial launch, the SDPA kernel expand
  picks at the S2 shape's attention calls, which optional kernels (flash-attn, fla, liger) import.
- S1 exactness: expand and flex against dense in float32 and bfloat16 (bf16 judged against the float32 truth, with
  the dense bf16 path, kept off cuDNN, as the yardstick), score/train/chunked on a Llama-like model; flex on a
  Gemma-2-like model (head dim 256, softcaps, windows) with gradients; flex at an MLA head dim of 192; a depth-3 tree
  on each backend; structure-built BlockMasks equal to ``create_block_mask``; the kernels against torch.
- S2 score speed at Qwen2.5-1.5B dims, P=4096, C=512, G=16, bf16: dense, kv_expand, expand, flex and, where
  installed, trl, liger and prefix_grouper, with log-prob agreement beside the time.
- S3 peak memory against ``plan`` at P=16k, G=64, C=1k (no-grad and ``chunked_backward``).
- S4 train speed at the S2 shape with G=4 (where dense training fits), then G=16 where memory allows: dense, expand,
  flex, chunked; each profiled step also reports its kernel launches and host syncs.
- S6 hybrids: a tiny Qwen3.5's prompts forwarded once and their children continuing from the forked recurrent states
  and keys/values, against full rows (log-probs and gradients), on the kernels transformers selects on the device;
  then the entry points (``compute_logps`` score and train, ``chunked_backward``) on it against the dense path.
- S5 (last) the inductor/Triton compile caches (under ``.gpu-cache/``) archived into ``OUT`` when small, for reuse.

Without CUDA every stage runs at tiny shapes on CPU (a dry run of the plumbing, tested in ``make test``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Stages in the order they run: S5 (the cache archive) last, after S6 (hybrids).
STAGES = ("S0", "S1", "S2", "S3", "S4", "S6", "S5")
#: Estimated seconds of each stage, cold (no compile cache), and the most a stage may take on CUDA so later stages
#: keep their share of the deadline. CPU figures are the dry run's on a loaded 2-core machine.
ESTIMATE_S = {
    "cuda": {"S0": 40, "S1": 130, "S2": 80, "S3": 60, "S4": 150, "S6": 110, "S5": 25},
    "cpu": {"S0": 8, "S1": 20, "S2": 8, "S3": 8, "S4": 8, "S6": 14, "S5": 2},
}
CAP_S = {"S0": 60, "S1": 200, "S2": 120, "S3": 90, "S4": 200, "S6": 150, "S5": 30}
#: Seconds kept back for S5 (the cache archive) whatever the other stages do.
S5_RESERVE_S = 8
#: Seconds a stage may run past the end of its share before the driver stops it.
STOP_GRACE_S = 5.0
RESULTS = "results.jsonl"


# ----------------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------------


class Recorder:
    """Appends result lines to ``out/results.jsonl`` (flushed per line) and echoes them to stdout."""

    def __init__(self, out: Path, stage: str):
        self.path = out / RESULTS
        self.stage = stage

    def record(self, name: str, status: str, **figures) -> dict:
        line = {"stage": self.stage, "name": name, "status": status, "time": round(time.time(), 1), **figures}
        text = json.dumps(line, default=_jsonable)
        with open(self.path, "a") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        print(f"[{self.stage}] {name}: {status} {text}", flush=True)
        return line


def _jsonable(value):
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value)
    except ImportError:
        pass
    return repr(value)


class Checks:
    """Runs a stage's checks in order, each skipped when its estimate exceeds the time left before ``until``."""

    def __init__(self, recorder: Recorder, until: float):
        self.recorder = recorder
        self.until = until
        self.failed = 0

    def left(self) -> float:
        return self.until - time.time()

    def run(self, name: str, estimate_s: float, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` returns ``(ok, figures)`` or a figures dict (ok); an exception is a failure."""
        if estimate_s > self.left():
            return self.recorder.record(
                name, "skipped", reason=f"estimated {estimate_s:.0f} s > {max(self.left(), 0):.0f} s left"
            )
        start = time.time()
        try:
            result = fn(*args, **kwargs)
            ok, figures = result if isinstance(result, tuple) else (True, result)
            status = "ok" if ok else "failed"
        except Exception as error:  # a check that raises is a result, not the end of the stage
            status, figures = "failed", {"error": f"{type(error).__name__}: {error}"[:600]}
            figures["traceback"] = traceback.format_exc(limit=6)[-1500:]
        if status == "failed":
            self.failed += 1
        return self.recorder.record(name, status, seconds=round(time.time() - start, 2), **figures)


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers of the stages (imported lazily: ``run`` never imports torch)
# ----------------------------------------------------------------------------------------------------------------


def _setup_paths():
    for path in (ROOT, ROOT / "tests"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dense_off_cudnn():
    """A context in which SDPA may use every kernel but cuDNN: the dense bf16 yardstick must not share a kernel
    (and its defects) with the expand path it judges, which cuDNN may serve on sm90."""
    from shared_prefix_logps.backends import sdpa_kernels

    return sdpa_kernels.excluded("CUDNN_ATTENTION")


# ----------------------------------------------------------------------------------------------------------------
# S0 environment
# ----------------------------------------------------------------------------------------------------------------


def stage_s0(checks: Checks, device) -> None:
    import platform

    import torch
    import transformers

    def versions():
        figures = {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "none",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "transformers": transformers.__version__,
            "commit": os.environ.get("GIT_COMMIT", "unknown"),
        }
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            figures.update(
                capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=props.multi_processor_count,
            )
        for name in ("triton", "peft", "trl", "liger_kernel", "prefix_grouper", "flash_attn", "fla", "hypothesis"):
            try:
                module = __import__(name)
                figures[name] = getattr(module, "__version__", "installed")
            except Exception as error:
                figures[name] = f"not importable ({type(error).__name__})"
        return figures

    checks.run("versions", 1, versions)

    def sdpa_priority():
        from shared_prefix_logps.backends import sdpa_kernels

        return {"order": list(sdpa_kernels.torch_priority(device))}

    checks.run("sdpa priority order", 1, sdpa_priority)

    def triton_launch():
        from shared_prefix_logps.kernels import launch_probe

        if device.type != "cuda":
            return {"skipped_reason": "no CUDA device: Triton kernels run under TRITON_INTERPRET only"}
        start = time.time()
        launch_probe.trial_launch(device)
        trial_s = time.time() - start
        status = launch_probe.cuda_launch_status(device)
        return status.ok, {"trial_launch_s": round(trial_s, 2), "probe_ok": status.ok, "probe": status.reason}

    checks.run("triton trial launch", 5, triton_launch)

    def expand_kernels():
        """The SDPA kernel expand chooses at each attention call of the S2 shape (2 layers of Qwen2.5-1.5B dims)."""
        from shared_prefix_logps import compute_logps
        from shared_prefix_logps.backends import sdpa_kernels
        from shared_prefix_logps.bench.presets import build_preset
        from shared_prefix_logps.bench.runner import Shape, make_batch

        cuda = device.type == "cuda"
        shape = Shape(1, 4096, 512, 16) if cuda else Shape(1, 64, 16, 4)
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_preset("qwen2.5-1.5b" if cuda else "tiny", dtype=dtype, device=device, layers=2)
        batch = make_batch(shape, model.config.vocab_size, device)
        seen = {}
        original = sdpa_kernels.choose

        def spy(query, key, value, mask, **kwargs):
            choice = original(query, key, value, mask, **kwargs)
            signature = (
                f"q{tuple(query.shape)} k{tuple(key.shape)} mask "
                f"{None if mask is None else tuple(mask.shape)} causal={kwargs.get('is_causal')} "
                f"grad={torch.is_grad_enabled()}"
            )
            seen[signature] = f"{choice.kernel}{' (KV heads repeated)' if choice.repeat_kv else ''}"
            return choice

        sdpa_kernels.choose = spy
        try:
            for train in (False, True):
                with torch.set_grad_enabled(train):
                    out = compute_logps(
                        model,
                        batch.prompts,
                        batch.completions,
                        prompt_mask=batch.prompt_mask,
                        completion_mask=batch.completion_mask,
                        backend="expand",
                    )
                    if train:
                        out.logps.sum().backward()
        finally:
            sdpa_kernels.choose = original
        _sync(device)
        if not cuda:
            seen["note"] = "on CPU expand takes its CPU path: no fused-kernel choice is made"
        return {"shape": str(shape), "choices": seen}

    checks.run("expand SDPA kernel at the S2 shape", 20 if device.type == "cuda" else 4, expand_kernels)


# ----------------------------------------------------------------------------------------------------------------
# S1 exactness
# ----------------------------------------------------------------------------------------------------------------

FP32_LOGPS_TOL, FP32_GRAD_TOL = 1e-4, 1e-3


def _modes(backend, device):
    """Modes a backend runs here: flex has no backward on CPU."""
    return ("score",) if backend == "flex" and device.type != "cuda" else ("score", "train", "chunked")


def _against_dense(result, reference) -> dict:
    """Figures of one ``run_mode`` result (logps, entropy, grads or None) against the dense one: the largest log-prob
    and entropy differences, and the largest relative gradient error where the result has gradients."""
    from support.exactness import max_relative_grad_error

    logps, entropy, grads = result
    ref_logps, ref_entropy, ref_grads = reference
    figures = {
        "logps_max_abs": float((logps - ref_logps).abs().max()),
        "entropy_max_abs": float((entropy - ref_entropy).abs().max()),
    }
    if grads is not None:
        figures["grad_max_rel"] = float(max_relative_grad_error(grads, ref_grads))
    return figures


def stage_s1(checks: Checks, device) -> None:
    import torch
    from support.exactness import max_relative_grad_error, run_mode
    from support.gpu_models import gpu_test_model
    from support.tiny_models import make_batch

    cuda = device.type == "cuda"
    compile_s = 25 if cuda else 2  # a cold flex compilation per family, dtype and grad mode

    def batch_on(seed=1):
        return tuple(t.to(device) for t in make_batch(3, 4, 40, 24, seed=seed))

    def kernels():
        from shared_prefix_logps.kernels import linear_logps, logsoftmax_gather

        gen = torch.Generator(device=device).manual_seed(0)
        figures, ok = {}, True
        for dtype in (torch.float32, torch.bfloat16):
            n, vocab, hidden = (1000, 32003, 256) if cuda else (64, 1003, 32)
            logits = torch.randn(n, vocab, device=device, generator=gen).mul_(3).to(dtype).requires_grad_()
            targets = torch.randint(0, vocab, (n,), device=device, generator=gen)
            logps, entropy = logsoftmax_gather(logits, targets, temperature=0.7, return_entropy=True)
            upstream = torch.randn(n, device=device, generator=gen)
            (logps * upstream).sum().backward()
            reference = torch.log_softmax(logits.detach().float() / 0.7, -1)
            want = reference.gather(1, targets[:, None]).squeeze(1)
            want_entropy = -(reference.exp() * reference).sum(1)
            onehot = torch.nn.functional.one_hot(targets, vocab).float()
            want_grad = upstream[:, None] * (onehot - reference.exp()) / 0.7
            tag = str(dtype).removeprefix("torch.")
            figures[f"gather {tag} logps"] = float((logps - want).abs().max())
            figures[f"gather {tag} entropy"] = float((entropy - want_entropy).abs().max())
            # The gradient is stored in the logits' dtype: bf16 rounds it to 2^-8 of its own size.
            figures[f"gather {tag} grad rel"] = float(
                (logits.grad.float() - want_grad).abs().max() / want_grad.abs().max()
            )
            ok &= figures[f"gather {tag} logps"] <= 2e-5 and figures[f"gather {tag} entropy"] <= 2e-4
            ok &= figures[f"gather {tag} grad rel"] <= (2**-7 if dtype == torch.bfloat16 else 1e-5)
            hidden_states = torch.randn(n, hidden, device=device, generator=gen).to(dtype).requires_grad_()
            weight = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(dtype)
            weight.requires_grad_()
            fused = linear_logps(hidden_states, weight, targets, temperature=0.7, softcap=30.0)
            fused.sum().backward()
            fused_grads = (hidden_states.grad.float(), weight.grad.float())
            hidden_states.grad = weight.grad = None
            logits_ref = hidden_states.float() @ weight.float().T
            logits_ref = torch.tanh(logits_ref / 30.0) * 30.0
            plain = torch.log_softmax(logits_ref / 0.7, -1).gather(1, targets[:, None]).squeeze(1)
            plain.sum().backward()
            figures[f"linear_logps {tag} logps"] = float((fused - plain).abs().max())
            figures[f"linear_logps {tag} weight grad rel"] = float(
                (fused_grads[1] - weight.grad.float()).abs().max() / weight.grad.float().abs().max()
            )
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            ok &= figures[f"linear_logps {tag} logps"] <= tol
            ok &= figures[f"linear_logps {tag} weight grad rel"] <= (1e-4 if dtype == torch.float32 else 2e-2)
        figures["all_nonpositive"] = bool((logps <= 0).all())
        return ok and figures["all_nonpositive"], figures

    checks.run("kernels against torch", 10 if cuda else 2, kernels)

    llama = gpu_test_model("llama").to(device)
    batch = batch_on()
    reference = run_mode(llama, "train", "dense", batch, temperature=0.7)
    for backend in ("expand", "flex"):
        for mode in _modes(backend, device):

            def fp32(backend=backend, mode=mode):
                result = run_mode(llama, mode, backend, batch, temperature=0.7)
                figures = _against_dense(result, reference)
                figures["masked_zero"] = bool((result[0][~batch[3]] == 0).all())
                ok = figures["logps_max_abs"] <= FP32_LOGPS_TOL and figures["entropy_max_abs"] <= FP32_LOGPS_TOL
                ok &= figures["masked_zero"] and figures.get("grad_max_rel", 0.0) <= FP32_GRAD_TOL
                return ok, figures

            first_flex = backend == "flex" and mode in ("score", "train")
            checks.run(f"fp32 {backend} {mode} (llama)", compile_s if first_flex else 3, fp32)

    def bf16_setup():
        model = gpu_test_model("llama", torch.bfloat16).to(device)
        exact = gpu_test_model("llama", torch.float32).to(device)
        exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        truth = run_mode(exact, "train", "dense", batch)
        with _dense_off_cudnn():
            dense = run_mode(model, "train", "dense", batch)
        return model, truth, dense

    model16, truth, dense16 = bf16_setup()
    mask = batch[3]

    def grads_float(grads):
        return {name: grad.float() for name, grad in grads.items()}

    for backend in ("expand", "flex"):
        for mode in _modes(backend, device):

            def bf16(backend=backend, mode=mode):
                logps, _, grads = run_mode(model16, mode, backend, batch)
                dense_err = (dense16[0] - truth[0])[mask].abs()
                ours_err = (logps - truth[0])[mask].abs()
                figures = {
                    "dense_bf16_err_max": float(dense_err.max()),
                    "dense_bf16_err_mean": float(dense_err.mean()),
                    "err_max": float(ours_err.max()),
                    "err_mean": float(ours_err.mean()),
                }
                ok = ours_err.max() <= 2 * dense_err.max() + 1e-3 and ours_err.mean() <= 1.5 * dense_err.mean() + 1e-4
                if grads is not None:
                    figures["dense_bf16_grad_rel"] = float(max_relative_grad_error(grads_float(dense16[2]), truth[2]))
                    figures["grad_rel"] = float(max_relative_grad_error(grads_float(grads), truth[2]))
                    ok &= figures["grad_rel"] <= 2 * figures["dense_bf16_grad_rel"] + 1e-2
                return bool(ok), figures

            first_flex = backend == "flex" and mode in ("score", "train")
            checks.run(f"bf16 {backend} {mode} (llama, dense off cuDNN)", compile_s if first_flex else 3, bf16)

    def gemma_flex():
        family = "gemma2-hd256" if cuda else "gemma2"
        model = gpu_test_model(family).to(device)
        gemma_batch = batch_on(seed=2)
        mode = "train" if cuda else "score"
        result = run_mode(model, mode, "flex", gemma_batch, temperature=0.7)
        reference = run_mode(model, "train", "dense", gemma_batch, temperature=0.7)
        figures = {"family": family, "mode": mode, **_against_dense(result, reference)}
        ok = figures["logps_max_abs"] <= FP32_LOGPS_TOL and figures.get("grad_max_rel", 0.0) <= FP32_GRAD_TOL
        return ok, figures

    checks.run("flex gemma2 head dim 256, softcaps, windows", 2 * compile_s, gemma_flex)

    def tree(backend):
        from support.tiny_models import build_model
        from support.trees import pad_rows, random_tree_rows

        from shared_prefix_logps import compute_logps_tree

        model = build_model("llama", hidden=64).to(device)  # head_dim 16: inductor's CUDA flex needs >= 16
        rows = random_tree_rows(3, depth=3, branching=3)
        ids, attention, score = (t.to(device) for t in pad_rows(rows, 3))
        grad = cuda or backend != "flex"

        def run(which):
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(grad):
                out = compute_logps_tree(model, ids, attention, score, backend=which, return_entropy=True)
                grads = None
                if grad:
                    (
                        out.logps * torch.linspace(0.5, 1.5, out.logps.numel(), device=device).view_as(out.logps)
                    ).sum().backward()
                    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            return out.logps.detach(), grads

        logps, grads = run(backend)
        ref_logps, ref_grads = run("dense")
        figures = {"rows": len(rows), "grad": grad, "logps_max_abs": float((logps - ref_logps).abs().max())}
        if grads is not None:
            figures["grad_max_rel"] = float(max_relative_grad_error(grads, ref_grads))
        ok = figures["logps_max_abs"] <= FP32_LOGPS_TOL and figures.get("grad_max_rel", 0.0) <= FP32_GRAD_TOL
        return ok, figures

    for backend in ("expand", "flex"):
        checks.run(f"tree depth 3 {backend}", compile_s if backend == "flex" else 3, tree, backend)

    def block_masks():
        from support.block_sparse import block_sets
        from support.trees import planned_node_calls, random_tree_rows
        from torch.nn.attention.flex_attention import create_block_mask

        from shared_prefix_logps.backends import flex

        compared = 0
        for seed in range(3):  # node calls of tries of depth 4, in chunks (stores out of depth-first order)
            rows = random_tree_rows(seed, depth=4, branching=3, max_segment=70)
            for call in planned_node_calls(rows, rows_per_chunk=3)[1]:
                call = call.to(device)
                n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
                q_len, kv_len = flex.padded_length(n, device), flex.padded_length(keys, device)
                for window in (None, 7, 200):
                    ours = flex.node_block_mask(call, window, q_len, kv_len)
                    theirs = create_block_mask(ours.mask_mod, None, None, q_len, kv_len, device=str(device))
                    mine, want = block_sets(ours), block_sets(theirs)
                    for key in mine:
                        if not torch.equal(mine[key].cpu(), want[key].cpu()):
                            return False, {"seed": seed, "window": window, "differs": key}
                    compared += 1
        return {"masks_compared": compared}

    checks.run("structure-built BlockMask == create_block_mask", 10, block_masks)

    def mla_192():
        """flex at a query/key head dim of 192 (MLA: DeepSeek-V3's 128 + 64), score against dense."""
        import transformers

        config = transformers.DeepseekV3Config(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=1,
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=128 if cuda else 16,
            qk_rope_head_dim=64 if cuda else 8,
            v_head_dim=128 if cuda else 16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            max_position_embeddings=512,
        )
        torch.manual_seed(0)
        model = transformers.DeepseekV3ForCausalLM(config).to(device).eval()
        mla_batch = tuple(t.to(device) for t in make_batch(2, 2, 40, 16, seed=4))
        for t in (mla_batch[0], mla_batch[2]):
            t.remainder_(512)
        logps, _, _ = run_mode(model, "score", "flex", mla_batch)
        ref_logps, _, _ = run_mode(model, "score", "dense", mla_batch)
        figures = {"qk_head_dim": config.qk_nope_head_dim + config.qk_rope_head_dim}
        figures["logps_max_abs"] = float((logps - ref_logps).abs().max())
        return figures["logps_max_abs"] <= FP32_LOGPS_TOL, figures

    checks.run("flex MLA head dim 192 (score)", compile_s, mla_192)


def stage_s6(checks: Checks, device) -> None:
    # Cold on an H200: about 100 s (flash-linear-attention's kernels compile at first use where installed).
    checks.run(
        "hybrid state forking (qwen3_5 prompts -> children)",
        100 if device.type == "cuda" else 4,
        _hybrid_forking,
        device,
    )
    for mode in ("score", "train", "chunked"):
        checks.run(
            f"hybrid entry point {mode} (qwen3_5, expand)",
            8 if device.type == "cuda" else 3,
            _hybrid_entry,
            mode,
            device,
        )


def _hybrid_entry(mode: str, device):
    """A tiny Qwen3.5 through the library's entry points (``compute_logps`` without and with gradients,
    ``chunked_backward``) on the engine's ``expand`` layout, against the dense path: log-probs, entropy and every
    parameter's gradient. Left-padded prompts (one of a single token), ragged completions."""
    import transformers
    from packaging.version import Version
    from support.exactness import run_mode
    from support.hybrid_models import build_hybrid
    from support.tiny_models import make_batch

    from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS

    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        return {"note": f"transformers {transformers.__version__} < {MIN_TRANSFORMERS}: hybrids are refused"}
    model = build_hybrid("qwen3_5_text").to(device)
    shape = (3, 4, 40, 24) if device.type == "cuda" else (2, 2, 12, 6)  # the CPU dry run checks the plumbing
    batch = tuple(t.to(device) for t in make_batch(*shape, seed=2))
    result = run_mode(model, mode, "expand", batch, temperature=0.7)
    figures = _against_dense(result, run_mode(model, "train", "dense", batch, temperature=0.7))
    ok = figures["logps_max_abs"] <= FP32_LOGPS_TOL and figures["entropy_max_abs"] <= FP32_LOGPS_TOL
    return ok and figures.get("grad_max_rel", 0.0) <= FP32_GRAD_TOL, figures


def _hybrid_forking(device):
    """A tiny Qwen3.5 (Gated DeltaNet + attention): 3 prompts (1, 3, 66 tokens) forwarded once, 6 children continuing
    from their end states (recurrent layers, shared_prefix_logps.recurrent) and keys/values (attention layers, the
    model's own cache), against each full row through the model's own forward: log-probs and every parameter's
    gradient. On CUDA the layer runs whichever chunked kernel transformers selects there (flash-linear-attention's
    where it imports, which must return the initial state's gradient)."""
    import torch
    import transformers
    from packaging.version import Version
    from support.exactness import max_relative_grad_error, parameter_grads
    from support.hybrid_models import GDN_CHUNK_SIZE, VOCAB, build_hybrid, recurrent_layers
    from support.state_forking import fork_cache, forward_nodes, positions, select_states, spans_of
    from transformers import DynamicCache

    from shared_prefix_logps.recurrent import install, uninstall
    from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS

    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        return {"note": f"transformers {transformers.__version__} < {MIN_TRANSFORMERS}: hybrids are refused"}
    model = build_hybrid("qwen3_5_text").to(device)
    layers = recurrent_layers(model)
    install(layers)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 3, GDN_CHUNK_SIZE + 2)]
        lengths = (4, 1, GDN_CHUNK_SIZE, GDN_CHUNK_SIZE + 1, 2, 30)
        children = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
        parent_list = [0, 0, 1, 1, 2, 2]

        def padded(rows, left):
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, row in enumerate(rows):
                span = slice(width - len(row), width) if left else slice(0, len(row))
                ids[i, span], mask[i, span] = torch.tensor(row), True
            return ids.to(device), mask.to(device)

        prompt_ids, prompt_mask = padded(prompts, left=True)
        cache = DynamicCache(config=model.config)
        _, ends = forward_nodes(model, prompt_ids, prompt_mask, positions(prompt_mask), spans_of(prompt_mask), cache)
        parent = torch.tensor(parent_list, device=device)
        child_ids, child_mask = padded(children, left=False)
        logits, _ = forward_nodes(
            model,
            child_ids,
            torch.cat([prompt_mask[parent], child_mask], 1),
            prompt_mask.sum(1)[parent][:, None] + torch.arange(child_ids.shape[1], device=device),
            spans_of(child_mask),
            fork_cache(model, cache, parent),
            select_states(ends, parent),
            keep_ends=False,
        )
        full_ids, full_mask = padded([prompts[p] + c for p, c in zip(parent_list, children)], left=True)
        reference = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
        weight = torch.randn(logits.shape, generator=gen).to(device)
        ours = torch.log_softmax(logits.float(), -1)
        loss, reference_loss, worst = 0.0, 0.0, 0.0
        width = full_ids.shape[1]
        for row, child in enumerate(children):
            got = ours[row, : len(child)]
            want = torch.log_softmax(reference[row, width - len(child) :].float(), -1)
            worst = max(worst, float((got - want).abs().max()))
            loss = loss + (got * weight[row, : len(child)]).sum()
            reference_loss = reference_loss + (want * weight[row, : len(child)]).sum()
        grad_error = max_relative_grad_error(parameter_grads(model, loss), parameter_grads(model, reference_loss))
        kernel = type(layers[0]).__module__
        figures = {"logps_max_abs": worst, "grad_max_rel": float(grad_error), "layer_module": kernel}
        return worst <= FP32_LOGPS_TOL and grad_error <= FP32_GRAD_TOL, figures
    finally:
        uninstall(layers)


# ----------------------------------------------------------------------------------------------------------------
# S2 / S4 speed (the bench runner's interleaved cell) and S3 memory
# ----------------------------------------------------------------------------------------------------------------


def _speed_cell(
    checks: Checks, device, *, workload: str, generations: int, methods: list[str], estimate_s: float, label=None
):
    """The timed cell of ``methods`` on ``workload`` at G=``generations``; its checks are named ``label`` (default:
    the workload) and what they are."""
    import torch

    label = label or workload
    from shared_prefix_logps.bench.methods import METHODS, method_unavailable
    from shared_prefix_logps.bench.presets import build_preset
    from shared_prefix_logps.bench.runner import Shape, make_batch, run_cell

    cuda = device.type == "cuda"
    shape = Shape(1, 4096, 512, generations) if cuda else Shape(1, 32, 8, min(generations, 4))
    preset = "qwen2.5-1.5b" if cuda else "tiny"
    layers = None if cuda else 1  # the dry run tests plumbing, not speed
    model = build_preset(preset, dtype=torch.bfloat16 if cuda else torch.float32, device=device, layers=layers)
    model.train(False)
    train = workload == "train"
    runnable = [m for m in methods if method_unavailable(m) is None]
    for method in methods:
        if method not in runnable:
            checks.recorder.record(f"{label} {method}", "skipped", reason=method_unavailable(method))
    if "flex" in runnable:
        # Compile flex apart, so a compilation that cannot finish costs this line, not the timed cell.
        batch = make_batch(shape, model.config.vocab_size, device)

        def warm_flex():
            start = time.time()
            METHODS["flex"][0](model, batch, train)
            _sync(device)
            model.zero_grad(set_to_none=True)
            return {"first_call_s": round(time.time() - start, 1)}

        warm = checks.run(f"{label} flex warm-up (compilation)", 30 if cuda else 2, warm_flex)
        if warm["status"] != "ok":
            runnable.remove("flex")

    def cell():
        records = run_cell(model, runnable, shape, workload, repeats=3 if cuda else 1)
        figures = {"preset": preset, "shape": str(shape), "dtype": str(next(model.parameters()).dtype)}
        dense_ms = next((r.get("median_ms") for r in records if r["method"] == "dense"), None)
        ok = True
        for record in records:
            keep = {
                k: record.get(k)
                for k in ("status", "reason", "median_ms", "peak_bytes", "max_abs_diff_vs_dense", "tokens_per_s")
                if record.get(k) is not None
            }
            if dense_ms and record.get("median_ms"):
                keep["speedup_vs_dense"] = round(dense_ms / record["median_ms"], 3)
            figures[record["method"]] = keep
            ok &= record["status"] in ("ok", "OOM", "skipped")
        figures["flop_floor"] = records[0]["flop_floor"]
        figures["token_floor"] = records[0]["token_floor"]
        return ok, figures

    checks.run(f"{label} speed cell", estimate_s, cell)
    if cuda:
        batch = make_batch(shape, model.config.vocab_size, device)
        for method in [m for m in runnable if m in PROFILED]:
            checks.run(f"{label} {method} profile", 8, _profile_step, METHODS[method][0], model, batch, train)
            model.zero_grad(set_to_none=True)


#: Methods whose step S2 and S4 profile (the library's and the reference; competitors are timed only).
PROFILED = ("dense", "expand", "flex", "chunked")


def _host_syncs(step, model, batch, train) -> int:
    """The host syncs of one step: CUDA's sync debug mode warns at every operation that makes the host wait for the
    device, counted here (what ``bench --count-kernels`` counts on CPU)."""
    import warnings

    import torch

    device = next(model.parameters()).device
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, batch, train)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    model.zero_grad(set_to_none=True)
    return sum("synchronizing" in str(w.message) for w in caught)


def _profile_step(step, model, batch, train, top: int = 8) -> dict:
    """One step under torch.profiler: its wall time, the CUDA time its kernels took (a wall time far above it means
    the host is the bottleneck), its kernel launches, its most expensive kernels, and (another step) its host syncs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    step(model, batch, train)  # warm
    model.zero_grad(set_to_none=True)
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step(model, batch, train)
        _sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    events = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    attribute = "device_time_total" if events and hasattr(events[0], "device_time_total") else "cuda_time_total"
    kernels = sorted(events, key=lambda e: getattr(e, attribute), reverse=True)
    cuda_ms = sum(getattr(e, attribute) for e in kernels) / 1e3
    model.zero_grad(set_to_none=True)
    return {
        "wall_ms": round(wall_ms, 1),
        "kernel_ms": round(cuda_ms, 1),
        "kernel_launches": int(sum(e.count for e in kernels)),
        "host_syncs": _host_syncs(step, model, batch, train),
        "top_kernels": [f"{getattr(e, attribute) / 1e3:.1f} ms x{e.count} {e.key[:90]}" for e in kernels[:top]],
    }


def stage_s2(checks: Checks, device) -> None:
    methods = ["dense", "kv_expand", "expand", "flex", "trl", "liger", "prefix_grouper"]
    _speed_cell(checks, device, workload="score", generations=16, methods=methods, estimate_s=40)


def stage_s4(checks: Checks, device) -> None:
    methods = ["dense", "expand", "flex", "chunked"]
    _speed_cell(checks, device, workload="train", generations=4, methods=methods, estimate_s=50)
    # G=16 where memory allows (dense's rows may not fit: its record then says OOM), last, so a deadline cuts it first.
    _speed_cell(checks, device, workload="train", generations=16, methods=methods, estimate_s=60, label="train G=16")


#: How far S3's measured peaks may be from ``plan``'s prediction (|planned / measured - 1|), as the plan's tests allow.
PLAN_TOLERANCE = 0.15


def stage_s3(checks: Checks, device) -> None:
    import torch
    import transformers
    from support.gpu_models import peak_memory_config

    from shared_prefix_logps import chunked_backward, compute_logps
    from shared_prefix_logps.bench.memory import peak_memory
    from shared_prefix_logps.kernels import resolve_implementation
    from shared_prefix_logps.plan import Engine, Workload, load_dims, plan_memory
    from shared_prefix_logps.plan.api import MODEL_STATE_TERMS

    cuda = device.type == "cuda"
    prompt_len, completion_len, generations, per_chunk = (16384, 1024, 64, 8) if cuda else (128, 16, 8, 2)
    config = peak_memory_config()
    if not cuda:
        # Narrow widths for the dry run, as a config of their own: setting num_hidden_layers on the built config left
        # its layer_types at 8 layers, a config transformers would refuse and the plan now does.
        fields = {**config.to_dict(), "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128}
        fields.update(num_hidden_layers=2, layer_types=None)
        config = transformers.Qwen2Config.from_dict(fields)

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (1, prompt_len), device=device, generator=gen)
    comps = torch.randint(0, config.vocab_size, (generations, completion_len), device=device, generator=gen)
    head = resolve_implementation("auto", prompts)
    # Every node call goes through the model's own forward: the count shows how the token budget cut a no-grad call.
    forwards = [0]
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))

    def planned(method, mode):
        workload = Workload(
            1,
            prompt_len,
            completion_len,
            generations,
            mode=mode,
            dtype="bf16" if cuda else "fp32",
            generations_per_chunk=per_chunk,
            padded_prompts=False,
        )
        engine = Engine(device="cuda" if cuda else "cpu", head_implementation=head)
        memory = plan_memory(method, load_dims(config.to_dict()), workload, engine)
        return sum(size for name, size in memory.terms.items() if name not in MODEL_STATE_TERMS)

    def measure(backend, mode):
        if not cuda and backend == "flex":
            return True, {"note": "the CPU live-bytes tracker cannot see inside flex_attention; not measured"}
        # Nothing of an earlier measurement may stay allocated: the peak is counted from what is allocated now.
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        forwards[0] = 0
        with peak_memory(device) as measured:
            if mode == "score":
                with torch.no_grad():
                    out = compute_logps(model, prompts, comps, backend=backend)
            else:
                out = chunked_backward(
                    model, prompts, comps, lambda o, r: o.logps.sum(), generations_per_chunk=per_chunk, backend=backend
                )
        model.zero_grad(set_to_none=True)
        method = "chunked" if mode == "chunked" else backend
        plan_bytes = planned(method, "score" if mode == "score" else "train")
        peak = measured["peak_bytes"]
        figures = {
            "shape": f"P={prompt_len} C={completion_len} G={generations}",
            "generations_per_chunk": per_chunk,
            "peak_gib": round(peak / 2**30, 3),
            "planned_gib": round(plan_bytes / 2**30, 3),
            "measured_over_planned": round(peak / plan_bytes, 3),
            "model_forwards": forwards[0],
            "head_implementation": head,
            "finite_nonpositive": bool(torch.isfinite(out.logps).all() and (out.logps <= 0).all()),
        }
        if "base_bytes" in measured:
            figures["base_gib"] = round(measured["base_bytes"] / 2**30, 3)
        # The plan's tolerance (tests/plan/ holds it to the committed runs too): 15% either way.
        return figures["finite_nonpositive"] and abs(plan_bytes / peak - 1) <= PLAN_TOLERANCE, figures

    for backend in ("flex", "expand"):
        for mode in ("score", "chunked"):
            estimate = (25 if backend == "flex" else 10) if cuda else 2
            checks.run(f"peak memory {backend} {mode}", estimate, measure, backend, mode)


# ----------------------------------------------------------------------------------------------------------------
# S5 compile caches
# ----------------------------------------------------------------------------------------------------------------

#: The largest cache archive copied into OUT (a returned file may be at most 16 MiB).
CACHE_ARCHIVE_LIMIT = 15 * 2**20


def stage_s5(checks: Checks, out: Path) -> None:
    import tarfile

    cache = ROOT / ".gpu-cache"

    def archive():
        if not cache.is_dir() or not any(cache.iterdir()):
            return {"note": f"no cache under {cache}"}
        size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        target = out / "gpu-cache.tar.gz"
        with tarfile.open(target, "w:gz") as tar:
            tar.add(cache, arcname=".gpu-cache")
        packed = target.stat().st_size
        if packed > CACHE_ARCHIVE_LIMIT:
            target.unlink()
            return {"cache_bytes": size, "archive_bytes": packed, "note": "archive too large to return; removed"}
        return {"cache_bytes": size, "archive_bytes": packed, "archive": target.name}

    checks.run("compile cache archive", 2, archive)


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def run_stage(stage: str, out: Path, until: float) -> int:
    """One stage in this process; its results appended to ``out/results.jsonl``. Exit code 0 unless a check failed."""
    _setup_paths()
    recorder = Recorder(out, stage)
    checks = Checks(recorder, until)
    if stage == "S5":
        stage_s5(checks, out)
        return 1 if checks.failed else 0
    import torch

    device = _device()
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    stages = {"S0": stage_s0, "S1": stage_s1, "S2": stage_s2, "S3": stage_s3, "S4": stage_s4, "S6": stage_s6}
    stages[stage](checks, device)
    return 1 if checks.failed else 0


def _cuda_present() -> bool:
    """Whether a CUDA device is here, without importing torch (the driver stays light): nvidia-smi lists one."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


def stage_command(stage: str, out: Path, until: float) -> list[str]:
    """The command that runs ``stage`` in a process of its own, ending by ``until`` (epoch seconds)."""
    return [sys.executable, str(Path(__file__).resolve()), "stage", stage, "--out", str(out), "--until", str(until)]


def _recorded_since(path: Path, offset: int, stage: str) -> list[dict]:
    """The result lines of ``stage`` appended to ``path`` after byte ``offset`` (a line cut by a stopped process's
    end is left out)."""
    if not path.exists():
        return []
    with open(path, "rb") as handle:
        handle.seek(offset)
        text = handle.read().decode(errors="replace")
    lines = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("stage") == stage:
            lines.append(record)
    return lines


def _end_cut_line(path: Path) -> None:
    """Ends a line a stopped process left without its newline, so that the next line stays a line of its own."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")


def run_all(out: Path, deadline: float, stages=STAGES, *, command=stage_command) -> int:
    """Every stage in its own process (``command(stage, out, until)``), in order, within ``deadline`` (epoch
    seconds). Returns 1 if a check failed (or a stage ended with an error), else 0.

    A stage whose estimate exceeds the time left is skipped; one still running ``STOP_GRACE_S`` after its share of
    the time is stopped. A stopped stage is recorded as ``stopped``, with the checks it had recorded (``measured``,
    and ``failed_checks`` if any): running out of time is not a failed check, so it fails the run only when one of
    its checks had failed before it was stopped.
    """
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    kind = "cuda" if _cuda_present() else "cpu"
    driver = Recorder(out, "run")
    driver.record("start", "ok", device_kind=kind, deadline_s=round(deadline - time.time(), 1), stages=list(stages))
    failed, stopped = 0, 0
    for stage in stages:
        left = deadline - time.time() - (0 if stage == "S5" else S5_RESERVE_S)
        estimate = ESTIMATE_S[kind][stage]
        if estimate > left:
            Recorder(out, stage).record(
                "stage", "skipped", reason=f"estimated {estimate} s > {max(left, 0):.0f} s left before the deadline"
            )
            continue
        share = min(left, CAP_S[stage] if kind == "cuda" else left)
        until = time.time() + share
        start = time.time()
        offset = results.stat().st_size if results.exists() else 0
        process = subprocess.Popen(command(stage, out, until), start_new_session=True)
        try:
            code = process.wait(timeout=max(1.0, until - time.time() + STOP_GRACE_S))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        figures = {"seconds": round(time.time() - start, 1)}
        if code is None:
            _end_cut_line(results)
            recorded = _recorded_since(results, offset, stage)
            failed_checks = [r["name"] for r in recorded if r.get("status") == "failed"]
            status = "stopped"
            figures["reason"] = (
                f"stopped at the end of its {share:.0f} s share of the deadline; what it measured is above"
            )
            figures["measured"] = [r["name"] for r in recorded if r.get("status") == "ok"]
            if failed_checks:
                figures["failed_checks"] = failed_checks
            stopped += 1
            failed += bool(failed_checks)
        elif code == 0:
            status = "ok"
        else:
            status = "failed"
            figures["reason"] = f"exit code {code} (see the stage's failed lines and the log)"
            failed += 1
        Recorder(out, stage).record("stage", status, **figures)
    driver.record("end", "ok" if not failed else "failed", failed_stages=failed, stopped_stages=stopped)
    return 1 if failed else 0


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown_summary(results: Path) -> str:
    """A Markdown summary of a ``results.jsonl``: environment, one table row per check, the speed cells per method."""
    lines = []
    for line in results.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:  # a line cut by a stopped stage
            continue
        if isinstance(record, dict):
            lines.append(record)
    env = next((r for r in lines if r["stage"] == "S0" and r["name"] == "versions"), {})
    keys = ("gpu", "capability", "memory_gib", "torch", "cuda", "cudnn", "triton", "transformers", "commit")
    out = ["# GPU quick run", "", "; ".join(f"{k} {env[k]}" for k in keys if k in env), ""]
    out += ["| stage | check | status | figures |", "|---|---|---|---|"]
    cells = []
    for r in lines:
        if r["name"].endswith("speed cell") and r["status"] != "skipped":
            cells.append(r)
            continue
        figures = {k: v for k, v in r.items() if k not in ("stage", "name", "status", "time", "traceback")}
        text = ", ".join(
            f"{k} {json.dumps(v) if isinstance(v, (dict, list)) else _short(v)}" for k, v in figures.items()
        )
        text = text.replace("|", "/").replace("\n", " ")
        out.append(f"| {r['stage']} | {r['name']} | {r['status']} | {text[:1500]} |")
    for cell in cells:
        out += [
            "",
            f"## {cell['stage']} {cell['name']}: {cell.get('preset')} {cell.get('shape')} {cell.get('dtype')}",
            "",
        ]
        out.append(
            f"token floor {_short(cell.get('token_floor'))}, FLOP floor {_short(cell.get('flop_floor'))} "
            f"(best possible speed-up {_short(1 / cell['flop_floor']) if cell.get('flop_floor') else '?'}x)"
        )
        out += [
            "",
            "| method | status | median ms | speed-up vs dense | peak GiB | max abs diff vs dense |",
            "|---|---|---|---|---|---|",
        ]
        for method, r in cell.items():
            if not isinstance(r, dict):
                continue
            peak = r.get("peak_bytes")
            out.append(
                f"| {method} | {r.get('status')} | {_short(r.get('median_ms', ''))} | "
                f"{_short(r.get('speedup_vs_dense', ''))} | {'' if peak is None else f'{peak / 2**30:.2f}'} | "
                f"{_short(r.get('max_abs_diff_vs_dense', ''))} |"
            )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every stage within one deadline")
    run.add_argument("--out", required=True, type=Path)
    run.add_argument("--deadline-s", type=float, default=480.0, help="seconds from now for everything")
    run.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, in order")
    one = sub.add_parser("stage", help="one stage in this process")
    one.add_argument("stage", choices=STAGES)
    one.add_argument("--out", required=True, type=Path)
    one.add_argument("--until", type=float, required=True, help="epoch seconds the stage must end by")
    report = sub.add_parser("report", help="a Markdown summary of a results.jsonl")
    report.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    if args.command == "report":
        print(markdown_summary(args.results), end="")
        return 0
    if args.command == "run":
        stages = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = [s for s in stages if s not in STAGES]
        if unknown or not stages:
            parser.error(f"--stages: unknown or empty {unknown or stages}; choose from {', '.join(STAGES)}")
        return run_all(args.out, time.time() + args.deadline_s, stages)
    args.out.mkdir(parents=True, exist_ok=True)
    return run_stage(args.stage, args.out, args.until)


if __name__ == "__main__":
    sys.exit(main())

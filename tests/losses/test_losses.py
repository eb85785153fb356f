"""Tests for shared_prefix_logps.losses.

Three references for every loss type:
  * TRL 1.16's own ``GRPOTrainer._compute_loss``, called unbound on a stand-in ``self`` that provides the attributes it
    reads (no model, no trainer) and returns our tensors from ``_get_per_token_logps_and_entropies``;
  * ``trl_reference.trl_grpo_loss``, our transcription of the same formula;
  * ``grpo_loss`` on the full batch, which the micro-batch and DDP runs must reproduce (value and gradient).
Everything is float64 so that 1e-10 tolerances are meaningful.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
import time
import types
from collections import defaultdict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.trl_reference import trl_grpo_loss

from shared_prefix_logps.integrations.trl.loss import micro_batch_counts as trl_micro_batch_counts
from shared_prefix_logps.losses import (
    LOSS_TYPES,
    GRPOLossOptions,
    global_sequence_count,
    global_token_count,
    grpo_loss,
    grpo_loss_with_options,
    high_entropy_mask,
)
from shared_prefix_logps.losses.aggregation import SUMS_AND_NORMALIZERS
from shared_prefix_logps.losses.policy_terms import POLICY_TERMS

TOL = {"atol": 1e-10, "rtol": 1e-10}
DT = torch.float64
MAX_LEN = 12
LENGTHS = [3, 7, 0, 12, 9, 1, 5, 12]  # one empty row, two full rows: per-row widths differ a lot
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# Option sets applied on top of every loss type. Each one switches on a different part of TRL's _compute_loss.
CONFIGS = {
    "plain": {},
    "kl_delta_vllm": {"beta": 0.04, "delta": 1.5, "vllm": True},
    "kl_uncorrected": {"beta": 0.1, "use_bias_correction_kl": False},
    "sequence": {"importance_sampling_level": "sequence", "beta": 0.04},
    "entropy": {"top_entropy_quantile": 0.4, "entropy_coef": 0.01, "off_policy_mask_threshold": 0.05},
}


def _epsilons(loss_type):
    # cispo's epsilon_high is a cap on the ratio itself (ScaleRL recommends ~5); 1.3 clips a good share of our data
    return (0.2, 1.3) if loss_type == "cispo" else (0.2, 0.28)


def make_batch(seed=0, lengths=LENGTHS, width=MAX_LEN):
    """Synthetic per-token quantities shaped like TRL's: (B, C), right-padded, zeros at padding."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    maskf = mask.to(DT)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=DT)

    logps = -torch.rand(b, width, generator=g, dtype=DT) * 3.0 - 0.05
    # Old/ref policies 0.35 nats away on average: a large share of ratios land outside [0.8, 1.28] on both sides
    old = logps + 0.35 * rand(b, width)
    ref = logps + 0.3 * rand(b, width)
    sampling = old + 0.1 * rand(b, width)
    advantages = rand(b)
    entropies = torch.rand(b, width, generator=g, dtype=DT) * 2.0
    is_ratio = torch.rand(b, width, generator=g, dtype=DT) + 0.5
    return {
        "per_token_logps": (logps * maskf).requires_grad_(),
        "old_per_token_logps": old * maskf,
        "ref_per_token_logps": ref * maskf,
        "sampling_per_token_logps": sampling * maskf,
        "advantages": advantages,
        "completion_mask": mask,
        "entropies": (entropies * maskf).requires_grad_(),
        # TRL's vLLM ratio is exp((old - sampling) * mask): exactly 1 at padding
        "importance_sampling_ratio": torch.where(mask.bool(), is_ratio, 1.0),
    }


def _loss_kwargs(loss_type, cfg, batch, entropy_mask=None):
    """grpo_loss keyword arguments (besides the four positional tensors) for one option set."""
    eps_low, eps_high = _epsilons(loss_type)
    kw = {
        "loss_type": loss_type,
        "epsilon_low": eps_low,
        "epsilon_high": eps_high,
        "max_completion_length": MAX_LEN,
        "beta": cfg.get("beta", 0.0),
        "delta": cfg.get("delta"),
        "use_bias_correction_kl": cfg.get("use_bias_correction_kl", True),
        "importance_sampling_level": cfg.get("importance_sampling_level", "token"),
        "entropies": batch["entropies"],
        "entropy_coef": cfg.get("entropy_coef", 0.0),
        "off_policy_mask_threshold": cfg.get("off_policy_mask_threshold"),
        "sampling_per_token_logps": batch["sampling_per_token_logps"] if cfg.get("off_policy_mask_threshold") else None,
        "entropy_mask": entropy_mask,
    }
    if kw["beta"]:
        kw["ref_per_token_logps"] = batch["ref_per_token_logps"]
    if cfg.get("vllm"):
        kw["importance_sampling_ratio"] = batch["importance_sampling_ratio"]
    return kw


def _positional(batch):
    return (batch["per_token_logps"], batch["old_per_token_logps"], batch["advantages"], batch["completion_mask"])


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.16 _compute_loss on a stand-in trainer
# ---------------------------------------------------------------------------------------------------------------------


class _IdentityAccelerator:
    """Single-process stand-in for the accelerate calls _compute_loss makes (gather/reduce/pad are identities)."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_compute_loss(loss_type, cfg, batch, *, ga=1, steps_per_generation=1, num_items_in_batch=None):
    """Run TRL 1.16's ``GRPOTrainer._compute_loss`` itself on ``batch``; returns (loss, metrics dict)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    trainer_cls = trl_grpo.GRPOTrainer
    eps_low, eps_high = _epsilons(loss_type)
    b, c = batch["completion_mask"].shape
    logps, entropies = batch["per_token_logps"], batch["entropies"]

    stub = types.SimpleNamespace()
    stub._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    stub.get_high_entropy_mask = types.MethodType(trainer_cls.get_high_entropy_mask, stub)
    stub.get_off_policy_mask = trainer_cls.get_off_policy_mask  # staticmethods: plain functions on the class
    stub.get_gamma_weights = trainer_cls.get_gamma_weights
    stub.accelerator = _IdentityAccelerator()
    stub.model = types.SimpleNamespace(training=True)
    stub.args = types.SimpleNamespace(
        use_bias_correction_kl=cfg.get("use_bias_correction_kl", True),
        delta=cfg.get("delta"),
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
        steps_per_generation=steps_per_generation,
        entropy_target=0.0,
    )
    stub.loss_type = loss_type
    stub.epsilon_low, stub.epsilon_high = eps_low, eps_high
    stub.beta = cfg.get("beta", 0.0)
    stub.importance_sampling_level = cfg.get("importance_sampling_level", "token")
    stub.top_entropy_quantile = cfg.get("top_entropy_quantile", 1.0)
    stub.off_policy_mask_threshold = cfg.get("off_policy_mask_threshold")
    stub.use_vllm = stub.vllm_importance_sampling_correction = bool(cfg.get("vllm"))
    stub.max_completion_length = MAX_LEN
    stub.current_gradient_accumulation_steps = ga
    stub.entropy_coef = cfg.get("entropy_coef", 0.0)
    stub._entropy_bonus_enabled = stub.entropy_coef != 0.0
    stub.use_adaptive_entropy = False
    stub.aux_loss_enabled = False
    stub._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    mask = batch["completion_mask"]
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, c, dtype=torch.long),
        "completion_mask": mask,
        "advantages": batch["advantages"],
        "old_per_token_logps": batch["old_per_token_logps"],
        "ref_per_token_logps": batch["ref_per_token_logps"],
        "sampling_per_token_logps": batch["sampling_per_token_logps"],
        "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch,
    }
    if cfg.get("vllm"):
        inputs["importance_sampling_ratio"] = batch["importance_sampling_ratio"]
    loss = trainer_cls._compute_loss(stub, None, inputs)
    return loss, {k: v[0] for k, v in stub._metrics["train"].items()}


def _grads(loss, batch):
    return torch.autograd.grad(loss, [batch["per_token_logps"], batch["entropies"]], allow_unused=True)


def _assert_grads_close(got, want):
    for g, w in zip(got, want, strict=True):
        if w is None or g is None:
            assert g is None or torch.count_nonzero(g) == 0
            assert w is None or torch.count_nonzero(w) == 0
        else:
            torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_full_batch_matches_trl(loss_type, cfg_name):
    cfg = CONFIGS[cfg_name]
    batch = make_batch()
    q = cfg.get("top_entropy_quantile", 1.0)
    emask = high_entropy_mask(batch["entropies"], batch["completion_mask"], q) if q < 1.0 else None

    ours = grpo_loss(*_positional(batch), **_loss_kwargs(loss_type, cfg, batch, emask))
    trl_loss, trl_metrics = trl_compute_loss(loss_type, cfg, batch)
    ref_kw = _loss_kwargs(loss_type, cfg, batch)
    del ref_kw["entropy_mask"]
    transcribed = trl_grpo_loss(*_positional(batch), top_entropy_quantile=q, **ref_kw)

    torch.testing.assert_close(ours.loss, trl_loss, **TOL)
    torch.testing.assert_close(transcribed, trl_loss, **TOL)
    want = _grads(trl_loss, batch)
    _assert_grads_close(_grads(ours.loss, batch), want)
    _assert_grads_close(_grads(transcribed, batch), want)

    # Metrics carry TRL's names and values (single process: TRL's global means are our local means)
    for name, value in ours.metrics().items():
        if name in trl_metrics:
            assert value == pytest.approx(trl_metrics[name], abs=1e-6), name
    if loss_type in CLIPPED:
        assert "clip_ratio/region_mean" in trl_metrics and "clip_ratio/region_mean" in ours.metrics()


def _split(batch, sizes, trim=True):
    """Cut a batch into row blocks; each block is trimmed to its own longest row (its own padded width)."""
    assert sum(sizes) == batch["completion_mask"].size(0)
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        width = max(int(batch["completion_mask"][rows].sum(-1).max()), 1) if trim else MAX_LEN
        part = {k: v[rows, :width] if v.dim() == 2 else v[rows] for k, v in batch.items()}
        out.append(part)
        start += n
    return out


SPLITS = {2: [3, 5], 4: [1, 3, 2, 2]}


@pytest.mark.parametrize("n_micro", [2, 4])
@pytest.mark.parametrize("cfg_name", ["plain", "kl_delta_vllm", "sequence", "entropy"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_microbatch_sum_equals_full_batch(loss_type, cfg_name, n_micro):
    cfg = CONFIGS[cfg_name]
    full = make_batch(seed=1)
    q = cfg.get("top_entropy_quantile", 1.0)
    full_emask = high_entropy_mask(full["entropies"], full["completion_mask"], q) if q < 1.0 else None
    want = grpo_loss(*_positional(full), **_loss_kwargs(loss_type, cfg, full, full_emask))

    # Micro-batches are views of the same leaves, so gradients land in the same full-batch tensors
    parts = _split(full, SPLITS[n_micro])
    masks = [p["completion_mask"] for p in parts]
    widths = {m.size(1) for m in masks}
    assert len(widths) > 1 and len({int(m.sum()) for m in masks}) > 1  # unequal padding and token counts
    n_tok, n_seq = global_token_count(masks), global_sequence_count(masks)
    assert int(n_tok) == sum(LENGTHS) and int(n_seq) == len(LENGTHS)

    n_ent, offsets = None, [0]
    for m in masks:
        offsets.append(offsets[-1] + m.size(0))
    emasks = [None] * len(parts)
    if full_emask is not None:
        emasks = [full_emask[a:b, : m.size(1)] for a, b, m in zip(offsets[:-1], offsets[1:], masks, strict=True)]
        n_ent = global_token_count([e & (m != 0) for e, m in zip(emasks, masks, strict=True)])
    total = 0.0
    for part, emask in zip(parts, emasks, strict=True):
        kw = _loss_kwargs(loss_type, cfg, part, emask)
        out = grpo_loss(
            *_positional(part),
            num_items_in_batch=n_tok,
            num_sequences_in_batch=n_seq,
            num_entropy_items_in_batch=n_ent,
            **kw,
        )
        total = total + out.loss

    torch.testing.assert_close(total, want.loss, **TOL)
    _assert_grads_close(_grads(total, full), _grads(want.loss, full))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trl_microbatching_is_split_dependent_where_expected(loss_type):
    """Why global counts: TRL's per-micro-batch normalizers make grpo/bnpo/... depend on the split.

    With GA = steps_per_generation = number of micro-batches, TRL's dapo/cispo/vespo normalizer is the global token
    count and the micro-batch sum equals the full batch; the others do not (uneven split), while ours do (above).
    """
    cfg = {"beta": 0.04}
    full = make_batch(seed=2)
    want, _ = trl_compute_loss(loss_type, cfg, full)
    parts = _split(full, SPLITS[2], trim=False)
    n_items = full["completion_mask"].sum()
    got = sum(
        trl_compute_loss(loss_type, cfg, p, ga=2, steps_per_generation=2, num_items_in_batch=n_items)[0] for p in parts
    )
    if loss_type in ("dapo", "cispo", "vespo"):
        torch.testing.assert_close(got, want, **TOL)
    else:
        assert not torch.allclose(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cfg_name", ["plain", "kl_delta_vllm", "entropy"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_chunks_reproduce_one_trl_micro_batch(loss_type, cfg_name):
    """A chunked backward inside one TRL micro-batch (GA=2, steps_per_generation=4) gives TRL's own loss back."""
    cfg = CONFIGS[cfg_name]
    batch = make_batch(seed=5)
    n_gen = torch.tensor(4 * 37)  # TRL's num_items_in_batch: tokens of the whole generation batch
    want, _ = trl_compute_loss(loss_type, cfg, batch, ga=2, steps_per_generation=4, num_items_in_batch=n_gen)
    q = cfg.get("top_entropy_quantile", 1.0)
    emask = high_entropy_mask(batch["entropies"], batch["completion_mask"], q) if q < 1.0 else None
    counts = trl_micro_batch_counts(
        batch["completion_mask"],
        loss_type=loss_type,
        num_items_in_batch=n_gen,
        current_gradient_accumulation_steps=2,
        steps_per_generation=4,
        entropy_mask=emask,
    )
    total, start = 0.0, 0
    for part in _split(batch, [3, 5]):
        n = part["completion_mask"].size(0)
        part_emask = None if emask is None else emask[start : start + n, : part["completion_mask"].size(1)]
        start += n
        total = total + grpo_loss(*_positional(part), **_loss_kwargs(loss_type, cfg, part, part_emask), **counts).loss
    torch.testing.assert_close(total, want, **TOL)
    _assert_grads_close(_grads(total, batch), _grads(want, batch))


def test_test_data_exercises_clipping_kl_and_entropy_mask():
    """Guard against vacuous passes: the synthetic data must clip on both sides, and the options must bite."""
    batch = make_batch()
    args = _positional(batch)
    out = grpo_loss(*args, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28)
    assert out.clip_ratio_low > 0.05 and out.clip_ratio_high > 0.05
    unclipped = grpo_loss(*args, loss_type="dapo", epsilon_low=1e9, epsilon_high=1e9)
    assert unclipped.clip_ratio_region == 0 and abs(float((unclipped.loss - out.loss).detach())) > 1e-3
    cispo = grpo_loss(*args, loss_type="cispo", epsilon_high=1.3)
    assert cispo.cispo_clip_ratio > 0.05

    # KL: k3 >= 0, and without bias correction the loss moves by exactly beta * token-mean KL
    beta = 0.1
    with_kl = grpo_loss(
        *args,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=beta,
        ref_per_token_logps=batch["ref_per_token_logps"],
        use_bias_correction_kl=False,
    )
    assert with_kl.kl > 0.01
    torch.testing.assert_close(with_kl.loss - out.loss, beta * with_kl.kl, **TOL)

    # Entropy mask: the kept share matches the quantile, and dropped tokens get no policy gradient
    mask = batch["completion_mask"]
    emask = high_entropy_mask(batch["entropies"], mask, 0.3)
    kept = emask.sum().item() / mask.sum().item()
    assert 0.25 <= kept <= 0.35
    assert not emask[mask == 0].any()
    masked = grpo_loss(*args, loss_type="dapo", entropy_mask=emask)
    (grad,) = torch.autograd.grad(masked.loss, batch["per_token_logps"])
    assert torch.count_nonzero(grad[~emask]) == 0 and torch.count_nonzero(grad[emask]) > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_garbage_at_padding_is_ignored(loss_type):
    """Samplers can leave NaN/inf at padded positions; neither the loss nor its gradient may see them."""
    clean = make_batch(seed=3)
    dirty = {k: v.detach().clone() for k, v in clean.items()}
    pad = clean["completion_mask"] == 0
    dirty["per_token_logps"][pad] = 50.0
    dirty["old_per_token_logps"][pad] = float("nan")
    dirty["ref_per_token_logps"][pad] = -float("inf")
    dirty["importance_sampling_ratio"][pad] = float("nan")
    dirty["entropies"][pad] = float("nan")
    dirty["per_token_logps"].requires_grad_()
    kw = {"loss_type": loss_type, "max_completion_length": MAX_LEN, "beta": 0.04, "entropy_coef": 0.01}
    a, b = (
        grpo_loss(
            *_positional(x),
            ref_per_token_logps=x["ref_per_token_logps"],
            importance_sampling_ratio=x["importance_sampling_ratio"],
            entropies=x["entropies"],
            **kw,
        )
        for x in (clean, dirty)
    )
    assert torch.isfinite(b.entropy) and (b.kl is None or torch.isfinite(b.kl))
    torch.testing.assert_close(b.loss, a.loss, **TOL)
    (ga,) = torch.autograd.grad(a.loss, clean["per_token_logps"])
    (gb,) = torch.autograd.grad(b.loss, dirty["per_token_logps"])
    torch.testing.assert_close(gb, ga, **TOL)
    assert torch.count_nonzero(gb[pad]) == 0


def test_counts_and_argument_errors():
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[True, True, True, True]])]
    assert global_token_count(masks).item() == 7 and global_token_count(masks).dtype == torch.int64
    assert global_sequence_count(masks).item() == 3
    batch = make_batch()
    args = _positional(batch)
    with pytest.raises(ValueError, match="unknown loss_type"):
        grpo_loss(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(*args, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(*args, beta=0.1)
    # num_processes scales the loss (DDP averages gradients), counts as ints or tensors are interchangeable
    one = grpo_loss(*args, num_items_in_batch=40)
    two = grpo_loss(*args, num_items_in_batch=torch.tensor(40), num_processes=2)
    torch.testing.assert_close(two.loss, 2 * one.loss, **TOL)


# ---------------------------------------------------------------------------------------------------------------------
# Two processes, gloo, DDP
# ---------------------------------------------------------------------------------------------------------------------

VOCAB, HIDDEN = 11, 6
DDP_LENGTHS = [6, 2, 5, 0, 6, 3, 1, 4]  # rank 0 gets rows 0..3 (13 tokens), rank 1 rows 4..7 (14 tokens)


class _TinyPolicy(torch.nn.Module):
    """Bigram policy: embedding -> linear -> log-softmax; log-prob of each next token given the previous one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=DT))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, dtype=DT)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g, dtype=DT))
            self.head.bias.copy_(torch.randn(VOCAB, generator=g, dtype=DT) * 0.1)

    def forward(self, tokens, mask):
        logits = self.head(self.embed[tokens[:, :-1]])
        logps = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return logps * mask


def _ddp_data():
    g = torch.Generator().manual_seed(7)
    b, c = len(DDP_LENGTHS), max(DDP_LENGTHS)
    mask = (torch.arange(c)[None, :] < torch.tensor(DDP_LENGTHS)[:, None]).to(DT)
    tokens = torch.randint(0, VOCAB, (b, c + 1), generator=g)
    noise_old = 0.4 * torch.randn(b, c, generator=g, dtype=DT)
    noise_ref = 0.3 * torch.randn(b, c, generator=g, dtype=DT)
    advantages = torch.randn(b, generator=g, dtype=DT)
    return tokens, mask, noise_old, noise_ref, advantages


def _ddp_kwargs(loss_type):
    eps_low, eps_high = _epsilons(loss_type)
    return {
        "loss_type": loss_type,
        "epsilon_low": eps_low,
        "epsilon_high": eps_high,
        "beta": 0.04,
        "max_completion_length": max(DDP_LENGTHS),
    }


def _policy_loss(policy, rows, data, **kw):
    tokens, mask, noise_old, noise_ref, advantages = data
    logps = policy(tokens[rows], mask[rows])
    # old/ref log-probs are fixed offsets of the current ones: ratios far from 1 so clipping is active
    old = (logps.detach() + noise_old[rows]) * mask[rows]
    ref = (logps.detach() + noise_ref[rows]) * mask[rows]
    return grpo_loss(logps, old, advantages[rows], mask[rows], ref_per_token_logps=ref, **kw)


def _ddp_worker(rank, world, port, out_dir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        data = _ddp_data()
        half = len(DDP_LENGTHS) // world
        local = list(range(rank * half, (rank + 1) * half))
        micro = [local[:1], local[1:]]  # two accumulation steps of unequal size on each rank
        mask = data[1]
        n_tok = global_token_count([mask[m] for m in micro])
        n_seq = global_sequence_count([mask[m] for m in micro])
        result = {"n_tok": int(n_tok), "n_seq": int(n_seq)}
        for loss_type in LOSS_TYPES:
            policy = _TinyPolicy()
            model = torch.nn.parallel.DistributedDataParallel(policy)
            for i, rows in enumerate(micro):
                kw = _ddp_kwargs(loss_type)
                # no_sync on all but the last micro-batch: gradients accumulate locally, one all-reduce per step
                ctx = model.no_sync() if i < len(micro) - 1 else torch.enable_grad()
                with ctx:
                    out = _policy_loss(
                        model, rows, data, num_items_in_batch=n_tok, num_sequences_in_batch=n_seq,
                        num_processes=world, **kw,
                    )  # fmt: skip
                    out.loss.backward()
            result[loss_type] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_process_gloo_matches_full_batch(tmp_path):
    world = 2
    ctx = mp.start_processes(_ddp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("DDP workers did not finish in 120 s")

    data = _ddp_data()
    everything = list(range(len(DDP_LENGTHS)))
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["n_tok"] == sum(DDP_LENGTHS) and result["n_seq"] == len(DDP_LENGTHS)
        for loss_type in LOSS_TYPES:
            policy = _TinyPolicy()
            out = _policy_loss(policy, everything, data, **_ddp_kwargs(loss_type))
            out.loss.backward()
            if loss_type in CLIPPED:
                assert out.clip_ratio_region > 0
            for name, param in policy.named_parameters():
                assert param.grad.abs().max() > 1e-4, (loss_type, name)
                torch.testing.assert_close(result[loss_type][name], param.grad, **TOL, msg=f"{loss_type} {name}")


# ---------------------------------------------------------------------------------------------------------------------
# GRPOLossOptions and grpo_loss_with_options
# ---------------------------------------------------------------------------------------------------------------------

OPTION_NAMES = tuple(f.name for f in dataclasses.fields(GRPOLossOptions))


def _split_options(kw):
    """grpo_loss keyword arguments -> (GRPOLossOptions, the remaining tensor/count arguments)."""
    options = GRPOLossOptions(**{k: v for k, v in kw.items() if k in OPTION_NAMES})
    return options, {k: v for k, v in kw.items() if k not in OPTION_NAMES}


def test_grpo_loss_keywords_are_the_options():
    """grpo_loss keeps one keyword per option, with the option's default: the two entries cannot drift apart."""
    params = inspect.signature(grpo_loss).parameters
    for field in dataclasses.fields(GRPOLossOptions):
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert params[field.name].default == field.default, field.name
    assert set(POLICY_TERMS) == set(LOSS_TYPES) == set(SUMS_AND_NORMALIZERS)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_with_options_equals_grpo_loss(loss_type, cfg_name):
    """Bit for bit, in value, metrics and gradients, also under global counts and num_processes."""
    cfg = CONFIGS[cfg_name]
    batch = make_batch(seed=4)
    q = cfg.get("top_entropy_quantile", 1.0)
    emask = high_entropy_mask(batch["entropies"], batch["completion_mask"], q) if q < 1.0 else None
    kw = _loss_kwargs(loss_type, cfg, batch, emask)
    kw.update(num_items_in_batch=torch.tensor(90), num_sequences_in_batch=13, num_processes=2)
    if emask is not None:
        kw["num_entropy_items_in_batch"] = 17
    want = grpo_loss(*_positional(batch), **kw)
    options, tensors = _split_options(kw)
    got = grpo_loss_with_options(*_positional(batch), options, **tensors)

    assert torch.equal(got.loss, want.loss) and got.metrics() == want.metrics()
    for g, w in zip(_grads(got.loss, batch), _grads(want.loss, batch), strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


def test_options_are_frozen_and_keyword_only():
    options = GRPOLossOptions(loss_type="grpo", beta=0.04)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.beta = 0.0
    with pytest.raises(TypeError):
        GRPOLossOptions("grpo")
    assert dataclasses.replace(options, beta=0.0).beta == 0.0 and options.beta == 0.04
    assert options == GRPOLossOptions(loss_type="grpo", beta=0.04) and hash(options) == hash(
        GRPOLossOptions(loss_type="grpo", beta=0.04)
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_type": "ppo"}, ValueError, "unknown loss_type"),
        ({"loss_type": "dr_grpo"}, ValueError, "max_completion_length"),
        ({"importance_sampling_level": "row"}, ValueError, "importance_sampling_level"),
        ({"epsilon_low": "0.2"}, TypeError, "epsilon_low"),
        ({"epsilon_high": True}, TypeError, "epsilon_high"),
        ({"beta": None}, TypeError, "beta"),
        ({"delta": "2"}, TypeError, "delta"),
        ({"off_policy_mask_threshold": float("nan")}, ValueError, "off_policy_mask_threshold"),
        ({"entropy_coef": float("inf")}, ValueError, "entropy_coef"),
        ({"use_bias_correction_kl": 1}, TypeError, "use_bias_correction_kl"),
        ({"max_completion_length": 12.0}, TypeError, "max_completion_length"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length"),
        ({"num_processes": 0}, ValueError, "num_processes"),
        ({"num_processes": 2.0}, TypeError, "num_processes"),
        ({"sapo_temperature_neg": 0.0}, ValueError, "sapo_temperature_neg"),
        ({"vespo_k_pos": None}, TypeError, "vespo_k_pos"),
    ],
)
def test_options_validation_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        GRPOLossOptions(**kwargs)
    # grpo_loss validates through the same object, before touching any tensor
    batch = make_batch()
    with pytest.raises(error, match=match):
        grpo_loss(*_positional(batch), **kwargs)


def test_options_accept_ints_and_none_where_configs_hold_them():
    options = GRPOLossOptions(loss_type="dr_grpo", beta=0, epsilon_high=5, max_completion_length=12, delta=None)
    assert options.beta == 0 and options.max_completion_length == 12
    batch = make_batch()
    with pytest.raises(TypeError, match="GRPOLossOptions"):
        grpo_loss_with_options(*_positional(batch), {"loss_type": "dapo"})
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss_with_options(*_positional(batch), GRPOLossOptions(beta=0.1))


def test_trl_loss_options_read_every_setting_from_the_trainer():
    """The TRL plug-in's options carry the trainer's values (none left at a default), the entropy coefficient TRL
    applies to this micro-batch, and num_processes 1 (TRL's token count carries that factor)."""
    from shared_prefix_logps.integrations.trl.loss import loss_options

    args = types.SimpleNamespace(
        delta=1.7,
        use_bias_correction_kl=False,
        sapo_temperature_pos=0.9,
        sapo_temperature_neg=1.2,
        vespo_k_pos=1.1,
        vespo_lambda_pos=2.1,
        vespo_k_neg=3.1,
        vespo_lambda_neg=4.1,
        entropy_target=0.5,
    )
    trainer = types.SimpleNamespace(
        args=args,
        loss_type="sapo",
        epsilon_low=0.15,
        epsilon_high=0.3,
        beta=0.02,
        importance_sampling_level="sequence",
        off_policy_mask_threshold=0.4,
        max_completion_length=33,
        entropy_coef=0.03,
        _entropy_bonus_enabled=True,
        use_adaptive_entropy=True,
        _last_world_entropy=0.4,  # below the target: the adaptive controller applies the coefficient
    )
    options = loss_options(trainer)
    defaults = GRPOLossOptions()
    for name in OPTION_NAMES:
        if name != "num_processes":
            assert getattr(options, name) != getattr(defaults, name), name
    assert options.entropy_coef == 0.03 and options.num_processes == 1 and options.delta == 1.7
    trainer._last_world_entropy = 0.6
    assert loss_options(trainer).entropy_coef == 0.0

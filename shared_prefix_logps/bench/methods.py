"""The methods the benchmark puts side by side, each as one step on a GRPO-shaped batch.

A step is either ``score`` (log-probs without gradients, as for old/reference log-probs) or ``train`` (log-probs
with gradients and a backward of their sum). Every method returns the (rows, C) float32 log-probs it computed, so
the runner can check it against the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import chunked_backward, compute_logps
from . import competitors


@dataclass(frozen=True)
class Batch:
    """prompts (B, P) left-padded, completions (B*G, C) right-padded, with bool masks."""

    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    completions: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def generations(self) -> int:
        return self.completions.shape[0] // self.prompts.shape[0]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``[prompt | completion]`` rows (B*G, P+C) and their attention mask, as trainers build them."""
        g = self.generations
        ids = torch.cat([self.prompts.repeat_interleave(g, 0), self.completions], 1)
        mask = torch.cat([self.prompt_mask.repeat_interleave(g, 0), self.completion_mask], 1)
        return ids, mask


Step = Callable[[torch.nn.Module, Batch, bool], torch.Tensor]


def compute_logps_step(backend: str) -> Step:
    """The library's own step with attention ``backend``: ``compute_logps``, and with ``train`` the backward of the
    summed log-probs; returns the detached (rows, C) float32 log-probs."""

    def step(model, batch, train):
        with torch.set_grad_enabled(train):
            out = compute_logps(
                model,
                batch.prompts,
                batch.completions,
                prompt_mask=batch.prompt_mask,
                completion_mask=batch.completion_mask,
                backend=backend,
            )
            if train:
                out.logps.sum().backward()
        return out.logps.detach()

    return step


def _dense(model, batch, train):
    """The dense reference on the batch's real tokens: full ``[prompt | completion]`` rows through the model's own
    forward and a float32 log-softmax + gather over trainers' ``logits_to_keep`` positions, with no padding work
    the floors do not count.

    - Prompts of one real length are forwarded together, cut to that length: rows padded to the longest prompt
      (as trainers build them) would forward pads the shared path never forwards.
    - No attention mask: a row's only padding is then its completion's right padding, which causal attention keeps
      away from every real token, so the model runs causal attention (half the (query, key) pairs; a padding mask
      makes SDPA compute them all), as the floors count it. Pad positions are computed and masked out, as in every
      padded-layout method.

    With ``train`` one backward of the summed log-probs of all rows, every row's activations alive at once as in one
    forward of the batch. Returns the detached (rows, C) float32 log-probs, 0 where the completion is padded.
    """
    lengths = batch.prompt_mask.sum(1)
    g = batch.generations
    p = batch.prompts.shape[1]
    rows, parts = [], []
    with torch.set_grad_enabled(train):
        for length in lengths.unique().tolist():
            prompts = (lengths == length).nonzero().squeeze(1)
            bucket = (prompts[:, None] * g + torch.arange(g, device=prompts.device)).reshape(-1)
            completion_mask = batch.completion_mask[bucket]
            # Completion columns padded in every row of the bucket hold no token to score.
            width = max(1, int(completion_mask.sum(1).max()))
            completions = batch.completions[bucket, :width]
            # Left-padded prompts keep their real tokens in the last ``length`` columns.
            ids = torch.cat([batch.prompts[prompts, p - length :].repeat_interleave(g, 0), completions], 1)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=width + 1).logits[:, :-1].float()
            logps = torch.log_softmax(logits, -1).gather(-1, completions[..., None]).squeeze(-1)
            logps = logps.masked_fill(~completion_mask[:, :width], 0.0)
            rows.append(bucket)
            parts.append(torch.nn.functional.pad(logps, (0, batch.completions.shape[1] - width)))
        logps = torch.cat(parts)[torch.argsort(torch.cat(rows))]
        if train:
            logps.sum().backward()
    return logps.detach()


def _chunked(model, batch, train):
    if not train:
        return compute_logps_step("auto")(model, batch, train)
    out = chunked_backward(
        model,
        batch.prompts,
        batch.completions,
        lambda chunk, rows: chunk.logps.sum(),
        generations_per_chunk=max(1, batch.generations // 4),
        prompt_mask=batch.prompt_mask,
        completion_mask=batch.completion_mask,
    )
    return out.logps


def _kv_expand(model, batch, train):
    """KV-cache expansion (TRL PR #2669): prompt forward with a cache, cache repeated G times, completions on it."""
    g = batch.generations
    c = batch.completions.shape[1]
    with torch.set_grad_enabled(train):
        positions = (batch.prompt_mask.long().cumsum(1) - 1).clamp(min=0)
        prompt_out = model(
            input_ids=batch.prompts,
            attention_mask=batch.prompt_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = prompt_out.past_key_values
        cache.batch_repeat_interleave(g)
        first_logits = prompt_out.logits[:, -1:].repeat_interleave(g, 0)
        start = batch.prompt_mask.sum(1).repeat_interleave(g)[:, None]
        mask = torch.cat([batch.prompt_mask.repeat_interleave(g, 0), batch.completion_mask], 1)
        out = model(
            input_ids=batch.completions[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=start + torch.arange(c - 1, device=start.device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        logits = torch.cat([first_logits, out.logits], 1).float()
        logps = torch.log_softmax(logits, -1).gather(-1, batch.completions[..., None]).squeeze(-1)
        logps = logps.masked_fill(~batch.completion_mask, 0.0)
        if train:
            logps.sum().backward()
    return logps.detach()


def _trl_rows(model, batch, train):
    """Full rows through TRL's own fused chunked log-prob head (``add_fused_lm_head``), as GRPOTrainer does."""
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(model, "_bench_trl_head", False):
        add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
        model._bench_trl_head = True
    ids, mask = batch.rows()
    c = batch.completions.shape[1]
    labels = ids.masked_fill(~mask, -100)
    labels[:, :-c] = -100
    with torch.set_grad_enabled(train):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
        logps = out.log_probs[:, -c:].float().masked_fill(~batch.completion_mask, 0.0)
        if train:
            logps.sum().backward()
    return logps.detach()


def _trl_available() -> bool:
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_available() -> bool:
    """Whether flash-attn's kernels (FA3 or flash-attn 2) are installed (they run on CUDA only)."""
    from ..backends import flash_kernels

    return flash_kernels.kernels_for(torch.device("cuda")) is not None


#: name -> (step, available); every method trains on CPU too (flex through its materialized trie mask). "dense" is
#: the conventional full-row forward with trainers' usual ``logits_to_keep`` head, without padding work
#: (:func:`_dense`); "trl" full rows padded to the longest prompt, with their padding mask, through TRL's fused
#: chunked head.
#: The competitors of :mod:`.competitors` ("prefix_grouper", "liger") are always listed; they are skipped with
#: "not installed" where their package does not import.
METHODS: dict[str, tuple[Step, Callable[[], bool]]] = {
    "dense": (_dense, lambda: True),
    "trl": (_trl_rows, _trl_available),
    "kv_expand": (_kv_expand, lambda: True),
    "expand": (compute_logps_step("expand"), lambda: True),
    "flex": (compute_logps_step("flex"), lambda: True),
    "flash": (compute_logps_step("flash"), _flash_available),
    "chunked": (_chunked, lambda: True),
    **{name: (step, available) for name, (step, available, _) in competitors.COMPETITORS.items()},
}


def method_unavailable(name: str) -> str | None:
    """Why ``name`` cannot run here (unknown, or its package not installed), or None when it can."""
    if name not in METHODS:
        return f"unknown method {name!r}; choose from {', '.join(METHODS)}"
    _, available = METHODS[name]
    if not available():
        package = competitors.COMPETITORS[name][2] if name in competitors.COMPETITORS else name
        package = "'shared-prefix-logps[flash]'" if name == "flash" else package
        return f"not installed (pip install {package})"
    return None

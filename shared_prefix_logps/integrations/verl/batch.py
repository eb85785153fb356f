"""A verl micro-batch as trainer-shaped rows ``[left-padded prompt | right-padded response]``, or why it is not one.

verl's engine receives each micro-batch in its no-padding form (``left_right_2_no_padding``): ``input_ids`` and
``position_ids`` are jagged tensors of each sequence's valid tokens, while the padded ``prompts`` (N, P) (left-padded),
``responses`` (N, R) (right-padded) and ``attention_mask`` (N, P + R) it was made from travel along. The rows are
rebuilt from those three; the response part of ``attention_mask`` is the completion mask (``response_mask`` is the
loss mask: it also zeroes tool tokens in multi-turn data, which are still inputs). Everything verl's own forward would
read differently (other position ids, inputs that are not ``[prompts | responses]`` under the mask, options that need
more than log-probs and entropy) is a reason to leave the micro-batch to verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.rows import layout_problem


@dataclass
class VerlRows:
    """One micro-batch in the layout of :func:`~shared_prefix_logps.compute_logps_concatenated`.

    Attributes:
        input_ids: (N, P + R) int64, ``[left-padded prompt | right-padded response]``.
        attention_mask: (N, P + R) int64, 1 on real tokens.
        response_width: R, the ``logits_to_keep`` of the rows.
        offsets: (N + 1,) int64, start of each sequence in verl's flat (jagged) token order (``input_ids.offsets()``).
        prompt_lens: (N,) int64, valid prompt tokens per row.
        temperature: a float for every row, or an (N,) float32 tensor (verl's per-sample temperature).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_width: int
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    temperature: float | torch.Tensor

    @property
    def response_mask(self) -> torch.Tensor:
        """(N, R) bool: the valid response (completion) tokens."""
        return self.attention_mask[:, -self.response_width :] != 0

    def response_positions(self) -> torch.Tensor:
        """(N, R) int64: where the log-prob of each response token sits in verl's flat sequence order.

        verl's output at a sequence's position t is the log-prob of token t + 1 (labels rolled by one), so response
        token j of row i sits at ``offsets[i] + prompt_lens[i] - 1 + j``; masked positions point past the row and
        must not be read.
        """
        start = self.offsets[:-1] + self.prompt_lens - 1
        return start[:, None] + torch.arange(self.response_width, device=start.device)[None, :]


def read_rows(micro_batch) -> tuple[VerlRows | None, str | None]:
    """The rows of ``micro_batch`` (a verl TensorDict after ``left_right_2_no_padding``) and None, or None and the
    reason they cannot be rebuilt exactly.

    ``prompts``/``responses`` come padded with the ``attention_mask`` they were padded with (verl's PPO trainer), or
    both jagged (verl's v1 trainer): the rows are then padded here, every token valid.
    """
    keys = set(micro_batch.keys())
    needed = ("prompts", "responses", "input_ids", "position_ids", "temperature")
    missing = [name for name in needed if name not in keys]
    if missing:
        return None, f"the micro-batch has no {', '.join(missing)}"  # SFT data has no prompts/responses
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    nested = [getattr(t, "is_nested", False) for t in (prompts, responses)]
    if all(nested):
        # verl's v1 trainer keeps prompts and responses jagged (no padding at all)
        input_ids, attention_mask = _pad_nested(prompts, responses)
    elif any(nested):
        return None, "one of prompts and responses is nested, the other padded"
    elif "attention_mask" not in keys or getattr(micro_batch["attention_mask"], "is_nested", False):
        return None, "padded prompts and responses without a padded attention_mask"
    elif prompts.dim() != 2 or responses.dim() != 2 or prompts.shape[0] != responses.shape[0]:
        return None, "prompts and responses are not (N, P) and (N, R) tensors"
    else:
        input_ids, attention_mask = torch.cat([prompts, responses], dim=1).long(), micro_batch["attention_mask"]
    width = _max_length(responses) if all(nested) else responses.shape[1]
    problem = layout_problem(input_ids, attention_mask, width)
    if problem is not None:
        return None, f"rows are not [left-padded prompt | right-padded response]: {problem}"
    valid = attention_mask != 0
    nested_ids, position_ids = micro_batch["input_ids"], micro_batch["position_ids"]
    if not getattr(nested_ids, "is_nested", False):
        return None, "input_ids is not a nested (no-padding) tensor"
    offsets = nested_ids.offsets().long()
    lengths = valid.sum(dim=1)
    if offsets.numel() != lengths.numel() + 1 or not torch.equal(offsets.diff(), lengths.to(offsets.device)):
        return None, "input_ids' sequence lengths differ from attention_mask's"
    if not torch.equal(nested_ids.values().long(), input_ids[valid]):
        return None, "input_ids are not [prompts | responses] under attention_mask"
    if position_ids.dim() == 3:
        return None, "3-D position ids (multimodal RoPE)"
    positions = position_ids.values() if getattr(position_ids, "is_nested", False) else None
    expected = torch.arange(int(offsets[-1]), device=offsets.device) - torch.repeat_interleave(offsets[:-1], lengths)
    if positions is None or not torch.equal(positions.long(), expected):
        return None, "position ids other than 0 .. length - 1 per sequence"
    temperature = micro_batch["temperature"]
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() == 1:
            temperature = float(temperature)
        elif temperature.shape != (input_ids.shape[0],):
            return None, f"temperature of shape {tuple(temperature.shape)} for {input_ids.shape[0]} rows"
        else:
            temperature = temperature.float()
    else:
        temperature = float(temperature)
    rows = VerlRows(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        response_width=width,
        offsets=offsets,
        prompt_lens=valid[:, : input_ids.shape[1] - width].sum(dim=1),
        temperature=temperature,
    )
    return rows, None


def _max_length(nested: torch.Tensor) -> int:
    return int(nested.offsets().diff().max()) if nested.size(0) else 0


def _pad_nested(prompts: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged prompts and responses -> ``[left-padded prompt | right-padded response]`` ids (N, P + R) and mask."""
    prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
    width_p, width_r = max(_max_length(prompts), 1), _max_length(responses)
    rows = prompt_lens.numel()
    device = prompts.values().device
    columns_p = torch.arange(width_p, device=device)[None, :]
    prompt_mask = columns_p >= (width_p - prompt_lens)[:, None]
    response_mask = torch.arange(width_r, device=device)[None, :] < response_lens[:, None]
    ids = torch.zeros((rows, width_p + width_r), dtype=torch.long, device=device)
    ids[:, :width_p][prompt_mask] = prompts.values().long()  # row-major order: each row's tokens in order
    ids[:, width_p:][response_mask] = responses.values().long()
    return ids, torch.cat([prompt_mask, response_mask], dim=1).long()


def temperature_groups(rows: VerlRows) -> list[tuple[float, torch.Tensor | None]]:
    """``(temperature, row indices or None for all rows)`` for each distinct temperature of the micro-batch.

    The shared path takes one temperature per call; verl's per-sample temperatures are usually all equal.
    """
    if not isinstance(rows.temperature, torch.Tensor):
        return [(rows.temperature, None)]
    values = torch.unique(rows.temperature)
    if values.numel() == 1:
        return [(float(values[0]), None)]
    return [(float(value), torch.nonzero(rows.temperature == value).flatten()) for value in values]


def option_problem(engine, micro_batch) -> str | None:
    """Why verl's options for this engine or micro-batch ask for more than the shared path computes, or None."""
    from verl.utils import tensordict_utils as tu

    def flag(key: str) -> bool:
        return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=False))

    if flag("use_fused_kernels"):
        return "use_fused_kernels=True (verl's fused log-prob kernels)"
    sp_size = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if sp_size > 1 or getattr(engine, "use_ulysses_sp", False):
        return f"Ulysses sequence parallel (size {sp_size})"
    if "multi_modal_inputs" in micro_batch.keys():
        return "multimodal inputs (multi_modal_inputs)"
    if flag("distillation_use_topk") or flag("distillation_only"):
        return "distillation (distillation_use_topk / distillation_only)"
    if flag("calculate_sum_pi_squared"):
        return "calculate_sum_pi_squared (needs the full-vocabulary distribution)"
    pad_mode = tu.get_non_tensor_data(data=micro_batch, key="pad_mode", default=None)
    if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)).lower() != "no_padding":
        return f"pad_mode {pad_mode} (only verl's no-padding micro-batches are rebuilt)"
    return None

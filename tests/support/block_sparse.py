"""What a BlockMask means to flex_attention's CUDA kernel, computed densely on CPU.

flex_attention's eager CPU implementation evaluates ``mask_mod`` at every (query, key) pair and ignores the block
structure, so a CPU run cannot tell a correct BlockMask from a wrong one. The Triton kernel visits only the listed
blocks and skips ``mask_mod`` on blocks listed as full. These helpers reproduce that reading on small shapes: a
block wrongly listed as full shows every pair in it, a visible block left out hides its pairs.
"""

from __future__ import annotations

import torch


def listed_blocks(num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """(rows, num_cols) bool: the blocks a (1, 1, rows) count / (1, 1, rows, cols) index pair lists, reading only each
    row's first ``count`` entries (as the kernels do)."""
    counts, indices = num_blocks[0, 0].long().cpu(), indices[0, 0].long().cpu()
    dense = torch.zeros(counts.numel(), num_cols, dtype=torch.bool)
    for row, count in enumerate(counts.tolist()):
        listed = indices[row, :count]
        assert listed.unique().numel() == count, f"row {row} lists a block twice"
        dense[row, listed] = True
    return dense


def block_sets(block_mask) -> dict[str, torch.Tensor]:
    """The partial and full blocks of ``block_mask`` as (q_blocks, kv_blocks) bool, from the kv-side lists and, when
    present, from the q-side (backward) lists transposed back."""
    q_len, kv_len = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    num_q, num_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    sets = {
        "partial": listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, num_kv),
        "full": listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, num_kv),
    }
    if block_mask.q_indices is not None:
        sets["q_partial"] = listed_blocks(block_mask.q_num_blocks, block_mask.q_indices, num_q).T
        sets["q_full"] = listed_blocks(block_mask.full_q_num_blocks, block_mask.full_q_indices, num_q).T
    return sets


def kernel_visibility(block_mask) -> torch.Tensor:
    """(q_len, kv_len) bool: the pairs flex's kernel lets through: ``mask_mod`` on partial blocks, everything on
    full blocks, nothing elsewhere."""
    q_len, kv_len = block_mask.seq_lengths
    size_q, size_kv = block_mask.BLOCK_SIZE
    sets = block_sets(block_mask)
    q_idx = torch.arange(q_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    evaluated = block_mask.mask_mod(zero, zero, q_idx, kv_idx).expand(q_len, kv_len)

    def spread(blocks):
        return blocks.repeat_interleave(size_q, 0).repeat_interleave(size_kv, 1)[:q_len, :kv_len]

    return (spread(sets["partial"]) & evaluated) | spread(sets["full"])


def kernel_attention(query, key, value, block_mask, scale, score_mod=None):
    """(1, heads, q_len, v_dim) attention as flex's kernel computes it under ``block_mask`` (rows that see nothing
    give zeros), for (1, heads, q_len, d) queries and (1, kv_heads, kv_len, d) keys/values."""
    heads, kv_heads = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // kv_heads, 1)
    value = value.repeat_interleave(heads // kv_heads, 1)
    scores = (query.double() @ key.double().transpose(-1, -2)) * scale
    if score_mod is not None:
        zero = torch.zeros((), dtype=torch.long)
        scores = score_mod(scores, zero, zero, zero, zero)
    visible = kernel_visibility(block_mask)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ value.double()).to(query.dtype)

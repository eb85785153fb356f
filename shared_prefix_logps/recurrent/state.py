"""A recurrent layer's state at the end of each node: what a node hands its children.

A recurrent layer (Gated DeltaNet, a Mamba2 mixer) summarises everything before a position in a fixed-size state:
the short causal convolution's window (its last ``kernel_size - 1`` inputs) and the recurrence's state (Gated
DeltaNet: per value head a ``head_k_dim x head_v_dim`` matrix; Mamba2: per head a ``head_dim x ssm_state_size``
matrix). A child node continues from its parent's end state exactly as the model's own cache continues a sequence, so
the state is all a child needs of its ancestors, however deep they go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentState:
    """One recurrent layer's state for ``rows`` nodes (dimension 0 of every tensor).

    A layer may keep several states of each kind (transformers' ``state_idx``); each mapping is keyed by that index.

    Attributes:
        conv: state index -> (rows, channels, kernel_size - 1), the layer's dtype: the convolution's last inputs,
            oldest first (zeros where the node's path holds fewer tokens).
        recurrence: state index -> (rows, ...) the recurrence's state in the dtype the layer's kernel returns it
            (Gated DeltaNet: (rows, v_heads, head_k_dim, head_v_dim) float32; Mamba2: (rows, heads, head_dim,
            ssm_state_size)). Empty for convolution-only layers.
    """

    conv: Mapping[int, torch.Tensor]
    recurrence: Mapping[int, torch.Tensor]

    @property
    def rows(self) -> int:
        """Number of nodes the state holds."""
        for tensor in self.tensors():
            return tensor.shape[0]
        raise ValueError("a RecurrentState holds no tensor")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, convolution states first, each kind by state index (the order :meth:`from_tensors`
        reads)."""
        return [self.conv[i] for i in sorted(self.conv)] + [self.recurrence[i] for i in sorted(self.recurrence)]

    def from_tensors(self, tensors: list[torch.Tensor]) -> RecurrentState:
        """A state of the same layout holding ``tensors`` (in :meth:`tensors` order)."""
        conv_keys, recurrence_keys = sorted(self.conv), sorted(self.recurrence)
        if len(tensors) != len(conv_keys) + len(recurrence_keys):
            raise ValueError(f"expected {len(conv_keys) + len(recurrence_keys)} tensors, got {len(tensors)}")
        conv = dict(zip(conv_keys, tensors[: len(conv_keys)]))
        recurrence = dict(zip(recurrence_keys, tensors[len(conv_keys) :]))
        return RecurrentState(conv=conv, recurrence=recurrence)

    def select(self, index: torch.Tensor) -> RecurrentState:
        """The states of nodes ``index`` ((n,) int64, repeats allowed): each child's initial state from its
        parent's end state. Differentiable; in backward the gradients of every child of a node add up in that
        node's row (``index_select``'s backward), so a parent's state sends its children's gradient back once."""
        return self.from_tensors([t.index_select(0, index.to(t.device, non_blocking=True)) for t in self.tensors()])

    @staticmethod
    def cat(states: list[RecurrentState]) -> RecurrentState:
        """The states of several node calls, one after the other (same layout)."""
        if not states:
            raise ValueError("cat needs at least one RecurrentState")
        first = states[0]
        columns = zip(*(state.tensors() for state in states))
        return first.from_tensors([torch.cat(column, dim=0) for column in columns])

    def zeros(self, rows: int) -> RecurrentState:
        """A zero state of the same layout for ``rows`` nodes: the state before a row's first token (the model's
        own convolution pads with zeros and its recurrence starts from zero)."""
        return self.from_tensors([t.new_zeros((rows, *t.shape[1:])) for t in self.tensors()])

    def detached(self) -> RecurrentState:
        """Leaves holding the same values that require grad: a node's end state cut from its node call's graph, so
        that its children's backward passes collect their gradients in ``.grad`` before the node's own backward
        runs once (``torch.autograd.backward(state.tensors(), [leaf.grad for leaf in leaves.tensors()])``)."""
        return self.from_tensors([t.detach().requires_grad_(t.is_floating_point()) for t in self.tensors()])

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor (the cost of keeping a node's state alive for its children)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

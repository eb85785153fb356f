"""The channel through which a recurrent layer's own forward reads a given initial state and hands back its end
state: a transformers ``Cache`` holding one linear-attention cache layer.

A transformers recurrent layer continues a sequence from its cache: it reads the convolution window and the
recurrence state (``cache.get_conv_state`` / ``get_recurrent_state``, or ``cache.layers[i].conv_states[0]`` and
``has_previous_state`` in transformers 5.15-5.17), prepends the window to its new convolution inputs
(``cache.update_conv_state`` returns the inputs to convolve), starts its chunked kernel from the recurrence state
(``initial_state=``) and stores the kernel's final state (``cache.update_recurrent_state``). :class:`StateCacheLayer`
answers those calls from a given :class:`~.state.RecurrentState` and records the end state, out of place:
transformers' own cache layers copy new states into fixed buffers in place (a static address for CUDA graphs), which
would overwrite the initial state that autograd saved and cut the gradient to the parent node.

It also reports ``record_past = True``: a one-token segment then takes the layer's multi-token convolution path
(``update_conv_state`` + ``causal_conv1d_fn``) instead of ``causal_conv1d_update``, which updates the window in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .state import RecurrentState

try:  # transformers >= 5.5 (the channel this module speaks is that of >= 5.15, see .families)
    from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - exercised only on old transformers
    Cache = LinearAttentionCacheLayerMixin = None


class _StateCacheLayerMethods:
    """The methods of :class:`StateCacheLayer`, apart from its transformers base class so that this module imports
    on transformers without linear-attention cache layers."""

    def __init__(self, start: RecurrentState | None, kernel_size: int | None, lengths: torch.Tensor | None = None):
        # A layer without a start reads no state (has_previous_state False): its convolution pads with zeros and
        # its recurrence starts from zero, as at a row's first token. With a start, exactly the state indices it
        # holds exist (transformers 5.15-5.17 read ``all(has_previous_state.values())``).
        indices = sorted(set(start.conv) | set(start.recurrence)) if start is not None else [0]
        LinearAttentionCacheLayerMixin.__init__(self, number_of_states=max(indices) + 1)
        self.record_past = True
        self.kernel_size = kernel_size
        self.start = start
        self.lengths = lengths  # (rows,) int64 on the device: real tokens of right-padded rows, or None
        self.end_conv: dict[int, torch.Tensor] = {}
        self.end_recurrence: dict[int, torch.Tensor] = {}
        if start is not None:
            self.has_previous_state = dict.fromkeys(indices, True)
            for index, window in start.conv.items():
                self.conv_states[index] = window
                self.is_conv_states_initialized[index] = True
            for index, state in start.recurrence.items():
                self.recurrent_states[index] = state
                self.is_recurrent_states_initialized[index] = True

    def lazy_initialization(self, *args, **kwargs) -> None:
        # Nothing to allocate: states are given (start) or recorded as returned (end), never copied into buffers.
        return None

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ) -> torch.Tensor:
        """The inputs the layer convolves: the start window (if any) followed by ``conv_states`` ((rows, channels,
        new tokens)); records the window after them."""
        kernel_size = conv_kernel_size if conv_kernel_size is not None else self.kernel_size
        if kernel_size is None:
            raise ValueError("the layer passed no conv_kernel_size and none was given to its state cache layer")
        start = self.start.conv.get(state_idx) if self.start is not None else None
        inputs = conv_states if start is None else torch.cat([start.to(conv_states.dtype), conv_states], dim=-1)
        width = kernel_size - 1
        if self.lengths is not None:
            # Right-padded rows: each row's window ends at its last real input (the start window, if any, is ahead of
            # the rows' inputs; a row shorter than the window takes zeros, or the start window, before it).
            padded = F.pad(inputs, (width, 0))
            offset = inputs.shape[-1] - conv_states.shape[-1]
            ends = offset + self.lengths
            index = ends[:, None] + torch.arange(width, device=ends.device)[None, :]
            self.end_conv[state_idx] = padded.gather(-1, index[:, None, :].expand(-1, padded.shape[1], -1))
            return inputs
        short = max(0, width - inputs.shape[-1])
        window = F.pad(inputs, (short, 0)) if short else inputs
        self.end_conv[state_idx] = window[..., window.shape[-1] - width :]
        return inputs

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Records the layer's final recurrence state (not copied: it keeps its graph)."""
        self.end_recurrence[state_idx] = recurrent_states
        return recurrent_states

    def end_state(self) -> RecurrentState:
        """The state after the layer's segment."""
        if not self.end_conv and not self.end_recurrence:
            raise ValueError("the layer stored no state in its cache; it cannot hand a state to a child node")
        return RecurrentState(conv=dict(self.end_conv), recurrence=dict(self.end_recurrence))


if LinearAttentionCacheLayerMixin is not None:

    class StateCacheLayer(_StateCacheLayerMethods, LinearAttentionCacheLayerMixin):
        """A linear-attention cache layer that starts from a given state and records its end state out of place."""


def state_cache(
    layer_idx: int, start: RecurrentState | None, kernel_size: int | None, lengths: torch.Tensor | None = None
):
    """(cache, layer): a transformers ``Cache`` whose entry ``layer_idx`` is a state cache layer starting from
    ``start`` (None: from the state before a row's first token). Pass the cache to the recurrent layer's forward
    where it takes its cache; read ``layer.end_state()`` afterwards. ``lengths``: (rows,) int64 real tokens of rows
    padded on the right, whose convolution windows end at their last real token.

    The cache holds no other layer: a recurrent layer's forward reads only its own entry.
    """
    if LinearAttentionCacheLayerMixin is None:
        raise ImportError("this transformers has no LinearAttentionCacheLayerMixin (transformers >= 5.15 needed)")
    layer = StateCacheLayer(start, kernel_size, lengths)
    layers = [None] * layer_idx + [layer]
    return Cache(layers=layers), layer

"""Recurrent layers of linear-attention hybrids (Qwen3.5, Qwen3-Next: Gated DeltaNet; Mamba2 mixers): a node's prefix
is the layer's state at the node's end, forked to every child.

Design (the interface a node call carries)
-----------------------------------------

What a node hands its children, per kind of layer:

- **attention layer**: its keys/values over the node's tokens. A child attends over the keys/values of *every*
  ancestor, so a node call keeps its (kv_heads, T, head_dim) keys/values and each descendant gathers its whole path.
- **recurrent layer**: its :class:`RecurrentState` at the node's last token: the convolution's last
  ``kernel_size - 1`` inputs and the recurrence's state. The state already summarises every ancestor, so a child
  needs its *parent's* end state only, whatever its depth: a node call keeps one row per node
  (``RecurrentCall.ends[layer]``) and its children's call starts from ``ends[layer].select(parent_row)``.
- a layer that holds both (Falcon-H1 runs attention and a Mamba2 mixer side by side) hands on both; they are separate
  modules, each keyed by its own module.

A node call over N nodes passes a :class:`RecurrentCall` as the model kwarg :data:`RECURRENT_CALL_KWARG`, holding the
nodes' :class:`NodeSpans` (where each node's tokens sit in the layer input: one per padded row, or packed back to
back) and, per recurrent layer, the N initial states (none for a call of top-level nodes). After the forward,
``call.release(model_output)`` returns each layer's N end states; their gradients travel back through the model's
output like the attention keys/values' (``forward/routing.py``). The states are small (Gated DeltaNet: per layer and
node ``v_heads * head_k_dim * head_v_dim`` float32 plus ``conv_dim * (kernel_size - 1)`` in the model dtype), so a
fork is an ``index_select``; in backward ``index_select`` adds the children's gradients into the parent's row.

Chunked backward and trees: detach a node's end states into leaves (:meth:`RecurrentState.detached`), run each child
chunk from ``leaves.select(...)`` and back-propagate it (the leaves collect every child's gradient), then send
``torch.autograd.backward(ends.tensors(), [leaf.grad ...])`` through the node's own call once: the attention
keys/values' pattern, with a state instead of keys/values.

Inside the forward, :func:`install` has wrapped each recurrent layer; under a call the wrapper runs
:func:`run_from_states`: one call of the layer's own forward per distinct node length, each node's tokens gathered
into an unpadded row, its initial state handed in and its end state read back through a transformers ``Cache``
holding one state cache layer (:mod:`.cache`) -- the channel the layer uses to continue a sequence, so the kernel
transformers selected (its torch fallbacks on CPU, flash-linear-attention / causal-conv1d / mamba-ssm on GPU) runs,
and its autograd reaches the initial state. No padding is ever scanned: a left-padded prompt gives the unpadded
prompt's state, a right-padded row ends where its tokens end, packed nodes do not run into each other.

Known limits (see :mod:`.families` for each family):

- A one-token node that starts from a state takes the layer's decode path. On CPU (transformers' torch fallbacks)
  Gated DeltaNet's is out of place and exact with gradients; flash-linear-attention's ``fused_recurrent`` kernel has no
  backward, and Mamba2's ``selective_state_update`` overwrites the state it read, so under gradients such a node must
  not start from a state that needs its gradient. A call of leaves (``RecurrentCall(..., keep_ends=False)``, e.g. the
  completions of the two-level trie) avoids it: its one-token nodes run as two copies of their token through the
  chunked path (per node: a node without children does so in any call). A one-token node between a parent and
  children is merged into its children by the engine's plan where the decode path cannot back-propagate
  (:class:`~.served.RecurrentPart`, ``engine/merge.py``'s ``split_one_token_forks``).
- One layer call per distinct node length: the packed ``cu_seqlens`` layout of flash-linear-attention (one call for
  every node) is not used yet; transformers' torch fallbacks ignore ``cu_seqlens``, so this module never passes it.
"""

from .call import RECURRENT_CALL_KWARG, RecurrentCall, install, uninstall
from .layer import run_from_states
from .spans import NodeSpans
from .state import RecurrentState

__all__ = [
    "RECURRENT_CALL_KWARG",
    "NodeSpans",
    "RecurrentCall",
    "RecurrentState",
    "install",
    "run_from_states",
    "uninstall",
]

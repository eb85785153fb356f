"""The attention layouts of a node call, one module each, listed in one table (``layouts``) and chosen by the
``backend`` option (``inputs.ATTENTION_BACKENDS``, derived from the table, resolved by ``choice``), each serving
every depth of the trie:

- ``expand``: each node a row attending with SDPA over its ancestors' gathered keys/values (any device; CPU's
  default);
- ``flex``: the call's tokens packed, one compiled ``flex_attention`` call per layer over the ancestors' keys/values
  in place, a mask built from the trie's structure (CUDA's default);
- ``flash``: the packed tokens on flash-attn's varlen kernels, one part per ancestor level and the own part merged by
  log-sum-exp (no mask, no copy of an ancestor).

They are called from inside the model's forward by ``forward/attention.py`` and import nothing from it: what a
layout reads arrives as arguments (the layer's queries, keys and values, and a ``layouts.LayerCall``: the node call,
its ancestors' keys/values, the call's cache, the layer's window and options). ``backend="dense"``
is the reference the entry points run instead (``engine/dense.py``).
"""

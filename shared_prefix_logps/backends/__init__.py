"""The attention backends, one module each, chosen by the ``backend`` option (``inputs.ATTENTION_BACKENDS``):

- ``expand``: Phase 2 rows attend with SDPA over their prompt's gathered keys/values (any device; CPU's default);
- ``flex``: rows packed into one sequence per phase, one compiled ``flex_attention`` call per layer (CUDA's default);
- ``flash``: the packed layout on flash-attn's varlen kernels, Phase 2 as a prefix part and an own part merged by
  log-sum-exp (no mask, no copy of a prefix);
- ``dense``: no phases, every ``[prompt | completion]`` row through the model's own forward (the reference path).

``expand``, ``flex`` and ``flash`` are called from inside the model's forward by ``forward/attention.py``; ``dense``
is called by the entry points instead of the phases.
"""

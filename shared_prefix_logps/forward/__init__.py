"""What runs inside the model's forward during a phase (and only there):

- ``context``: the phase context that travels with the forward as a model kwarg (survives wrappers' copies);
- ``attention``: the function registered with transformers' ``AttentionInterface``: the model's own attention
  outside a phase, the phase's backend (``backends/``) inside one;
- ``routing``: results computed inside a module leave through that module's output, for wrappers' sake.

The lm_head proxy that runs the fused head inside the forward is ``model/head_proxy.py``.
"""

"""What runs inside the model's forward during a node call (and only there):

- ``node_call``: what one node call forwards (``NodeCall``), built by the engine's call planner, read by the layouts;
- ``context``: the node call's context that travels with the forward as a model kwarg (survives wrappers' copies);
- ``attention``: the function registered with transformers' ``AttentionInterface``: the model's own attention
  outside a node call, the call's layout (``backends/``) inside one;
- ``head_proxy``, ``head_weights``: the lm_head's forward replaced by the fused head over the call's scored pairs,
  with the weight and bias a (PEFT-wrapped) head multiplies by;
- ``routing``: results computed inside a module leave through that module's output, for wrappers' sake.
"""

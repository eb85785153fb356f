"""Multi-process pieces of the core entry points.

- ``lockstep``: processes that see different rows still make the same model calls (wrappers whose forwards or
  backwards are collectives: DDP, FSDP1/FSDP2, DeepSpeed);
- ``ddp``: the DDP wrapper inside a model and the gradient averaging of DDP's synchronizing backward.
"""

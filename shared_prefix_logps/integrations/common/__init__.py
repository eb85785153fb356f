"""Trainer-neutral pieces of the plug-ins (TRL's, verl's): one module per job.

- ``patching``: replace instance attributes and restore exactly what each instance held;
- ``self_check``: compare the shared path's results with the trainer's own;
- ``stats``: what a plug-in did (``PatchStats``) and once-per-message warnings;
- ``rows``: row-layout checks and regrouping shuffled rows by prompt;
- ``lockstep``: keeping processes' model calls in step when forwards are collectives (FSDP);
- ``ddp``: DDP unwrapping and gradient averaging;
- ``modules``: autocast wrapper, dropout detection, temporary eval mode;
- ``backends``: the ``backend`` values every plug-in accepts.
"""

"""Trainer-neutral pieces of the plug-ins (TRL's, verl's, OpenRLHF's, ms-swift's): one module per job.

- ``patching``: replace instance attributes and restore exactly what each instance held;
- ``self_check``: compare the shared path's results with the trainer's own;
- ``stats``: what a plug-in did (``PatchStats``) and once-per-message warnings;
- ``rows``: row-layout checks and regrouping shuffled rows by prompt;
- ``scored_rows``: whole rows with a mask of scored tokens (OpenRLHF's, ms-swift's) re-laid as prompt and completion,
  and the results put back;
- ``lockstep``: keeping processes' model calls in step when forwards are collectives (FSDP);
- ``ddp``: DDP unwrapping and gradient averaging;
- ``modules``: autocast wrapper, dropout detection, temporary eval mode;
- ``backends``: the ``backend`` values every plug-in accepts;
- ``environment``: the switch, backend and self-check options that environment-configured plug-ins read alike.
"""

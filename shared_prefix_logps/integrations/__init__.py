"""Plug-ins for training libraries.

``shared_prefix_logps.integrations.trl``: :func:`~shared_prefix_logps.integrations.trl.patch_grpo_trainer` routes a
TRL ``GRPOTrainer``'s log-prob computation (and optionally its backward) through the shared-prefix path.

Nothing is imported here, so that importing the package never imports an optional training library.
"""

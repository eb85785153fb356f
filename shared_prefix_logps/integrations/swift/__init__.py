"""The ms-swift plug-in: every log-prob pass of ms-swift's ``GRPOTrainer`` (old policy, reference, teacher, policy)
through the shared prefix.

- one flag: ``swift rlhf --rlhf_type grpo ... --external_plugins $(python -m shared_prefix_logps.integrations.swift
  --plugin-path)`` installs it in every rank (:func:`plugin_path`, :func:`install`; options from the environment,
  :mod:`.install`);
- in one process: :func:`patch_trainer` / :func:`unpatch_trainer`, :func:`get_patch` (its ``stats``);
- :mod:`.patch`: what is served, what falls back to ms-swift's own method, the self-check.
"""

from pathlib import Path

from ..common.self_check import SelfCheckError
from .install import get_patch, install, installed, options_from_environment, patch_trainer, uninstall, unpatch_trainer
from .patch import SwiftPatch, SwiftStats

PLUGIN_FILE = Path(__file__).resolve().parent / "plugin" / "shared_prefix_logps_swift_plugin.py"


def plugin_path() -> str:
    """The file to pass to ms-swift's ``--external_plugins``. ms-swift puts its folder first on ``sys.path`` and
    imports it by file: the folder holds only that file, under a name no other module has."""
    return str(PLUGIN_FILE)


__all__ = [
    "SelfCheckError",
    "SwiftPatch",
    "SwiftStats",
    "get_patch",
    "install",
    "installed",
    "options_from_environment",
    "patch_trainer",
    "plugin_path",
    "uninstall",
    "unpatch_trainer",
]

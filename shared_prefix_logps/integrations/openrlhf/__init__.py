"""The OpenRLHF plug-in: the actor's three log-prob passes (policy, old policy, reference) through the shared prefix.

- :func:`patch_actor` / :func:`unpatch_actor`: one ``openrlhf.models.Actor`` (:mod:`.patch`);
- :func:`install` / :func:`setup_worker`: every actor of a process, and Ray's per-worker hook (:mod:`.install`);
  ``python -m shared_prefix_logps.integrations.openrlhf.launch ...`` runs OpenRLHF's launcher with it (:mod:`.launch`);
- :func:`install_group_order`: training micro-batches that keep each prompt's samples together (:mod:`.order`);
- :mod:`.outputs`: the ``output`` returned beside the log-probs; OpenRLHF's rows are re-laid as ``[left-padded prompt |
  right-padded completion]`` and back by :mod:`..common.scored_rows`.
"""

from ..common.self_check import SelfCheckError
from .install import install, setup_worker, uninstall, with_setup_hook
from .order import GroupShuffleSampler, install_group_order, uninstall_group_order
from .outputs import SharedPrefixActorOutput
from .patch import ActorPatch, ActorStats, get_patch, patch_actor, unpatch_actor

__all__ = [
    "ActorPatch",
    "ActorStats",
    "GroupShuffleSampler",
    "SelfCheckError",
    "SharedPrefixActorOutput",
    "get_patch",
    "install",
    "install_group_order",
    "patch_actor",
    "setup_worker",
    "uninstall",
    "uninstall_group_order",
    "unpatch_actor",
    "with_setup_hook",
]

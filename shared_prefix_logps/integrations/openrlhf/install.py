"""Installing the plug-in in every process of an OpenRLHF run: the class-level ``Actor.forward`` (every actor, options
from the environment), Ray's ``worker_process_setup_hook`` that does it in each worker, and the launcher that adds that
hook to OpenRLHF's own ``ray.init``.

Options (environment variables, read where each actor makes its first call; the launcher forwards them to workers):

- ``SHARED_PREFIX_LOGPS_OPENRLHF``: ``0`` leaves every actor to OpenRLHF (default ``1``);
- ``SHARED_PREFIX_LOGPS_OPENRLHF_BACKEND``: ``auto`` (default), ``expand`` or ``flex``;
- ``SHARED_PREFIX_LOGPS_OPENRLHF_SELF_CHECK``: ``1`` (default) or ``0``;
- ``SHARED_PREFIX_LOGPS_OPENRLHF_GROUP_ORDER``: ``1`` draws training micro-batches in the group-preserving order
  (:mod:`.order`); default ``0`` (OpenRLHF's sample shuffle).
"""

from __future__ import annotations

import functools
import os
import warnings

from ...errors import UnsupportedModelError
from ..common.environment import common_options, flag
from .order import install_group_order
from .patch import ORIGINAL_ATTRIBUTE, PATCH_ATTRIBUTE, ActorPatch

ENV_PREFIX = "SHARED_PREFIX_LOGPS_OPENRLHF"
SETUP_HOOK = "shared_prefix_logps.integrations.openrlhf.install.setup_worker"
_UNSET = object()


def options_from_environment() -> dict:
    """The patch options the environment sets (see the module docstring); raises ValueError on a bad value."""
    options = common_options(ENV_PREFIX)
    options["group_order"] = flag(f"{ENV_PREFIX}_GROUP_ORDER", "0")
    return options


def _actor_class():
    from openrlhf.models import actor

    return actor.Actor


def _class_forward(self, *args, **kwargs):
    """Installed as ``Actor.forward``: the actor's patch (made at its first call), or OpenRLHF's forward."""
    patch = self.__dict__.get(PATCH_ATTRIBUTE, _UNSET)
    if patch is _UNSET:
        options = options_from_environment()
        patch = None
        if options["enabled"]:
            try:
                patch = ActorPatch(self, backend=options["backend"], self_check=options["self_check"])
            except UnsupportedModelError as error:
                warnings.warn(f"shared_prefix_logps: this actor keeps OpenRLHF's forward: {error}", stacklevel=2)
        self.__dict__[PATCH_ATTRIBUTE] = patch
    if patch is None:
        return getattr(type(self).forward, ORIGINAL_ATTRIBUTE)(self, *args, **kwargs)
    return patch(*args, **kwargs)


def install() -> bool:
    """Patch ``openrlhf.models.Actor.forward`` for every actor of this process (and, with the group-order option, the
    training order). Returns False if it was installed already."""
    options = options_from_environment()
    cls = _actor_class()
    if options["group_order"]:
        try:
            install_group_order()
        except ImportError as error:  # a process without OpenRLHF's trainer (e.g. without vLLM): actors still served
            warnings.warn(f"shared_prefix_logps: no group-preserving order in this process: {error}", stacklevel=2)
    current = cls.__dict__["forward"]
    if getattr(current, ORIGINAL_ATTRIBUTE, None) is not None:
        return False

    @functools.wraps(current)
    def forward(self, *args, **kwargs):
        return _class_forward(self, *args, **kwargs)

    setattr(forward, ORIGINAL_ATTRIBUTE, current)
    cls.forward = forward
    return True


def uninstall() -> bool:
    """Undo :func:`install`'s ``Actor.forward`` (actors patched with ``patch_actor`` keep their patch). Returns False
    if it was not installed."""
    cls = _actor_class()
    original = getattr(cls.__dict__["forward"], ORIGINAL_ATTRIBUTE, None)
    if original is None:
        return False
    cls.forward = original
    return True


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook``: :func:`install` in a worker process. Workers without OpenRLHF (none in an
    OpenRLHF run) are left alone with a warning."""
    try:
        install()
    except ImportError as error:
        warnings.warn(f"shared_prefix_logps: OpenRLHF is not importable in this worker: {error}", stacklevel=2)


def with_setup_hook(runtime_env: dict | None) -> dict:
    """``runtime_env`` (Ray's) plus the plug-in's worker setup hook and the plug-in's options from this process's
    environment. Raises ValueError if the runtime environment has another setup hook (Ray takes one)."""
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={hook!r}; Ray runs one hook per worker: call "
            f"{SETUP_HOOK} from yours instead"
        )
    env["worker_process_setup_hook"] = SETUP_HOOK
    env_vars = dict(env.get("env_vars") or {})
    for name, value in os.environ.items():
        if name.startswith(ENV_PREFIX):
            env_vars.setdefault(name, value)
    env["env_vars"] = env_vars
    return env

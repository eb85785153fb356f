"""Installing the plug-in: the class-level ``GRPOTrainer`` methods (every trainer of a process, options from the
environment; what the ``--external_plugins`` file does), and :func:`patch_trainer` / :func:`unpatch_trainer` for one
trainer with options as arguments.

Options (environment variables, read at each trainer's first log-prob call; ``swift rlhf`` passes its environment on
to every rank it launches):

- ``SHARED_PREFIX_LOGPS_SWIFT``: ``0`` leaves every trainer to ms-swift (default ``1``);
- ``SHARED_PREFIX_LOGPS_SWIFT_BACKEND``: ``auto`` (default), ``expand`` or ``flex``;
- ``SHARED_PREFIX_LOGPS_SWIFT_SELF_CHECK``: ``1`` (default) or ``0``.
"""

from __future__ import annotations

import functools
import warnings

from ..common.environment import common_options
from ..common.patching import replace_attribute, restore_attributes
from .patch import LIGER_METHOD, LOGPS_METHOD, ORIGINAL_ATTRIBUTE, PATCH_ATTRIBUTE, SwiftPatch

ENV_PREFIX = "SHARED_PREFIX_LOGPS_SWIFT"
_UNSET = object()  # a trainer the class-level methods have not seen yet (None: a trainer left to ms-swift)
# each patched method and the SwiftPatch method that serves it
_METHODS = {LOGPS_METHOD: "logps", LIGER_METHOD: "liger_loss"}


def options_from_environment() -> dict:
    """The patch options the environment sets (see the module docstring); raises ValueError naming the variable on a
    bad value."""
    return common_options(ENV_PREFIX)


def trainer_class():
    """ms-swift's ``GRPOTrainer`` (``swift.rlhf_trainers.grpo_trainer``); ImportError without ms-swift, TypeError for
    a version without the method the plug-in replaces."""
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

    for name in _METHODS:
        if name not in GRPOTrainer.__dict__:
            raise TypeError(
                f"this ms-swift's GRPOTrainer defines no {name}; the plug-in is written against ms-swift 4.6.0"
            )
    return GRPOTrainer


def _patch_of(trainer) -> SwiftPatch | None:
    """The trainer's patch, made from the environment at its first call; None for a trainer left to ms-swift."""
    patch = trainer.__dict__.get(PATCH_ATTRIBUTE, _UNSET)
    if patch is _UNSET:
        options = options_from_environment()
        patch = None
        if options.pop("enabled"):
            patch = SwiftPatch(trainer, **options)
        trainer.__dict__[PATCH_ATTRIBUTE] = patch
    return patch


def _class_method(name: str, current):
    """The class-level replacement of ``GRPOTrainer.name``: the trainer's patch, or ms-swift's ``current``."""

    @functools.wraps(current)
    def method(self, *args, **kwargs):
        patch = _patch_of(self)
        if patch is None:
            return current(self, *args, **kwargs)
        return getattr(patch, _METHODS[name])(*args, **kwargs)

    setattr(method, ORIGINAL_ATTRIBUTE, current)
    return method


def install() -> bool:
    """Patch ms-swift's ``GRPOTrainer`` (``_get_per_token_logps_and_entropies``, and ``compute_liger_loss`` to count
    and warn about Liger's policy pass) for every trainer of this process. Returns False if installed already."""
    cls = trainer_class()
    if installed():
        return False
    for name in _METHODS:
        setattr(cls, name, _class_method(name, cls.__dict__[name]))
    return True


def uninstall() -> bool:
    """Undo :func:`install`: the class gets back exactly the functions it had (trainers patched with
    :func:`patch_trainer` keep their patch). Returns False if it was not installed."""
    cls = trainer_class()
    if not installed():
        return False
    for name in _METHODS:
        original = getattr(cls.__dict__[name], ORIGINAL_ATTRIBUTE, None)
        if original is not None:
            setattr(cls, name, original)
    return True


def installed() -> bool:
    """Whether ``GRPOTrainer``'s log-prob method is the plug-in's."""
    return getattr(trainer_class().__dict__[LOGPS_METHOD], ORIGINAL_ATTRIBUTE, None) is not None


def patch_trainer(trainer, *, backend: str = "auto", self_check: bool = True, self_check_tolerance=None) -> SwiftPatch:
    """Serve one ms-swift ``GRPOTrainer``'s log-prob passes through the shared-prefix path (instance attributes).

    Args:
        trainer: a built ``swift.rlhf_trainers.GRPOTrainer``.
        backend: completion-attention backend (``"auto"``: flex on CUDA, expand elsewhere).
        self_check: compare the first no-grad and the first grad call with ms-swift's own method (one extra no-grad
            forward each, once); raise :class:`~..common.self_check.SelfCheckError` on mismatch.
        self_check_tolerance: ``(max_abs, mean_abs)`` bounds of that comparison; None picks them from the dtype.

    Returns:
        The :class:`~.patch.SwiftPatch` (also what :func:`get_patch` returns).

    Raises:
        TypeError: not an ms-swift GRPOTrainer.
        ValueError: a bad ``backend`` or tolerance, or a trainer patched already.
    """
    previous = getattr(trainer, "__dict__", {}).get(PATCH_ATTRIBUTE)
    if previous is not None and previous is not _UNSET and previous.replaced:
        raise ValueError("this trainer is patched already; call unpatch_trainer(trainer) first")
    patch = SwiftPatch(trainer, backend=backend, self_check=self_check, self_check_tolerance=self_check_tolerance)
    for name, serving in _METHODS.items():
        replace_attribute(trainer, name, getattr(patch, serving), patch.replaced)
    trainer.__dict__[PATCH_ATTRIBUTE] = patch
    return patch


def unpatch_trainer(trainer) -> None:
    """Give ``trainer`` ms-swift's own methods back, also when the class is patched by :func:`install` (the trainer is
    then left to ms-swift from now on). The model keeps the library's attention function and head proxy, which pass
    through to the originals outside a shared-prefix call."""
    patch = trainer.__dict__.get(PATCH_ATTRIBUTE)
    if isinstance(patch, SwiftPatch):
        restore_attributes(patch.replaced)
    trainer.__dict__[PATCH_ATTRIBUTE] = None


def get_patch(trainer) -> SwiftPatch | None:
    """The trainer's :class:`~.patch.SwiftPatch` (its ``stats``), or None (none yet: the class-level install makes it
    at the trainer's first log-prob call)."""
    patch = trainer.__dict__.get(PATCH_ATTRIBUTE)
    return patch if isinstance(patch, SwiftPatch) else None


def install_from_plugin() -> None:
    """What the ``--external_plugins`` file runs: :func:`install`, with a warning instead of an error where ms-swift's
    trainer cannot be imported (the file is also replayed in dataloader workers)."""
    try:
        install()
    except ImportError as error:
        warnings.warn(f"shared_prefix_logps: ms-swift's GRPOTrainer is not importable here: {error}", stacklevel=2)

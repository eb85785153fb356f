"""How the verl plug-in is installed: the import hook on ``FSDPEngineWithLMHead.forward_step`` (every engine, options
from the environment) and ``patch_verl_engine``/``unpatch_verl_engine`` (one engine, options as arguments)."""

from __future__ import annotations

import functools

from ..common.patching import replace_attribute, restore_attributes
from .options import VerlOptions, options_from_environment
from .step import ORIGINAL_ATTRIBUTE, VerlPatch, engine_class, serves_log_probs, verl_forward_step

PATCH_ATTRIBUTE = "_shared_prefix_logps_patch"
_UNSET = object()  # an engine the hook has not seen yet (None: an engine left to verl)


def _class_forward_step(self, micro_batch, loss_function, forward_only):
    """Installed as ``FSDPEngineWithLMHead.forward_step``: the engine's patch (made from the environment at its first
    call), or verl's own step for engines the plug-in leaves alone."""
    original = verl_forward_step()
    if not serves_log_probs(self):
        return original(self, micro_batch, loss_function, forward_only)
    patch = self.__dict__.get(PATCH_ATTRIBUTE, _UNSET)
    if patch is _UNSET:
        options = options_from_environment()
        patch = VerlPatch(self, options) if options.enabled else None
        setattr(self, PATCH_ATTRIBUTE, patch)
    if patch is None:
        return original(self, micro_batch, loss_function, forward_only)
    return patch.forward_step(micro_batch, loss_function, forward_only)


def install() -> bool:
    """Patch ``FSDPEngineWithLMHead.forward_step`` for every engine (what importing the plug-in does). Returns False
    if it was patched already."""
    cls = engine_class()
    current = cls.__dict__["forward_step"]
    if getattr(current, ORIGINAL_ATTRIBUTE, None) is not None:
        return False
    wrapper = functools.wraps(current)(
        lambda self, micro_batch, loss_function, forward_only: _class_forward_step(
            self, micro_batch, loss_function, forward_only
        )
    )
    setattr(wrapper, ORIGINAL_ATTRIBUTE, current)
    cls.forward_step = wrapper
    return True


def uninstall() -> bool:
    """Undo :func:`install` (engines patched with :func:`patch_verl_engine` keep their patch). Returns False if the
    class was not patched."""
    cls = engine_class()
    original = getattr(cls.__dict__["forward_step"], ORIGINAL_ATTRIBUTE, None)
    if original is None:
        return False
    cls.forward_step = original
    return True


def installed() -> bool:
    """Whether ``FSDPEngineWithLMHead.forward_step`` is patched."""
    return getattr(engine_class().__dict__["forward_step"], ORIGINAL_ATTRIBUTE, None) is not None


def patch_verl_engine(
    engine,
    *,
    backend: str = "auto",
    self_check: bool = True,
    token_budget: int | None = None,
    tolerance: tuple[float, float] | None = None,
    log_every: int = 0,
) -> VerlPatch:
    """Serve one engine's ``forward_step`` through the shared-prefix path (an instance attribute), with these options.

    Args:
        engine: a built verl ``FSDPEngineWithLMHead`` (the actor's, or the reference model's).
        backend, self_check, token_budget, tolerance, log_every: see :class:`~.options.VerlOptions`.

    Returns:
        The :class:`VerlPatch` (also what :func:`get_patch` returns).

    Raises:
        NotImplementedError: not an ``FSDPEngineWithLMHead`` (Megatron and other engines), or a class that overrides
            ``forward_step``.
        ValueError: a value-head (critic) engine, or an engine patched already.
    """
    cls = engine_class()
    if not isinstance(engine, cls):
        raise NotImplementedError(
            f"patch_verl_engine supports verl's FSDPEngineWithLMHead only, got {type(engine).__name__} (the Megatron "
            "and other engines keep verl's own forward_step)"
        )
    if not serves_log_probs(engine):
        raise ValueError(f"{type(engine).__name__} computes values, not log-probs; nothing to patch")
    if type(engine).forward_step not in (cls.__dict__["forward_step"], verl_forward_step()):
        raise NotImplementedError(f"{type(engine).__name__} overrides forward_step; the patch replaces verl's own")
    previous = engine.__dict__.get(PATCH_ATTRIBUTE)
    if previous is not None and previous.replaced:
        raise ValueError("this engine is patched already; call unpatch_verl_engine(engine) first")
    patch = VerlPatch(engine, VerlOptions(True, backend, bool(self_check), token_budget, tolerance, log_every))
    replace_attribute(engine, "forward_step", patch.forward_step, patch.replaced)
    setattr(engine, PATCH_ATTRIBUTE, patch)
    return patch


def unpatch_verl_engine(engine) -> None:
    """Give ``engine`` verl's own ``forward_step`` back, also when the class is patched by the import hook."""
    patch = engine.__dict__.get(PATCH_ATTRIBUTE)
    if patch is not None:
        restore_attributes(patch.replaced)
    setattr(engine, PATCH_ATTRIBUTE, None)


def get_patch(engine) -> VerlPatch | None:
    """The engine's :class:`VerlPatch` (its ``stats``), or None if it has none (yet: the import hook makes it at the
    engine's first ``forward_step``)."""
    return engine.__dict__.get(PATCH_ATTRIBUTE)

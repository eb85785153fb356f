"""Options of the verl plug-in, read from the environment.

verl's hook (``actor_rollout_ref.model.external_lib=shared_prefix_logps.integrations.verl``) carries a module name and
nothing else, and the module is imported in every worker process, so the options travel as environment variables
(set them in the job's runtime environment, e.g. ``ray.init(runtime_env={"env_vars": {...}})`` or verl's
``+ray_kwargs.ray_init.runtime_env.env_vars``). They are read once per engine, at its first ``forward_step``.

==================================  =========================================================================
``SHARED_PREFIX_LOGPS``             ``on`` (default) or ``off``: ``off`` leaves every engine to verl's own code
``SHARED_PREFIX_LOGPS_BACKEND``     completion attention: ``auto`` (default: flex on CUDA, expand elsewhere),
                                    ``expand`` or ``flex``
``SHARED_PREFIX_LOGPS_SELF_CHECK``  ``1`` (default) or ``0``: compare the first no-grad and the first grad
                                    micro-batch with verl's own ``forward_step`` and raise on mismatch
``SHARED_PREFIX_LOGPS_TOKEN_BUDGET`` no-grad calls: the most tokens forwarded at once (default: the core's)
``SHARED_PREFIX_LOGPS_TOLERANCE``   ``max_abs,mean_abs`` bounds of the self-check (default: from the dtype)
==================================  =========================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BACKENDS = ("auto", "expand", "flex")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class VerlOptions:
    """What the plug-in does for one engine.

    Attributes:
        enabled: serve ``forward_step`` through the shared-prefix path (False: verl's own code, no warnings).
        backend: completion-attention backend (``"auto"``, ``"expand"``, ``"flex"``).
        self_check: compare the first no-grad and the first grad micro-batch with verl's own ``forward_step``.
        token_budget: no-grad calls: the most tokens forwarded at once; None: the core's default.
        tolerance: ``(max_abs, mean_abs)`` bounds of the self-check; None: from the compute dtype.
    """

    enabled: bool = True
    backend: str = "auto"
    self_check: bool = True
    token_budget: int | None = None
    tolerance: tuple[float, float] | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.token_budget is not None and (isinstance(self.token_budget, bool) or self.token_budget < 1):
            raise ValueError(f"token_budget must be a positive int or None, got {self.token_budget!r}")
        if self.tolerance is not None and len(self.tolerance) != 2:
            raise ValueError(f"tolerance must be (max_abs, mean_abs), got {self.tolerance!r}")


def _flag(environ, name: str, default: bool) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}, got {value!r}")


def options_from_environment(environ=None) -> VerlOptions:
    """The options the ``SHARED_PREFIX_LOGPS*`` variables of ``environ`` (default ``os.environ``) ask for."""
    environ = os.environ if environ is None else environ
    budget = environ.get("SHARED_PREFIX_LOGPS_TOKEN_BUDGET", "").strip()
    tolerance = environ.get("SHARED_PREFIX_LOGPS_TOLERANCE", "").strip()
    return VerlOptions(
        enabled=_flag(environ, "SHARED_PREFIX_LOGPS", True),
        backend=environ.get("SHARED_PREFIX_LOGPS_BACKEND", "auto").strip().lower() or "auto",
        self_check=_flag(environ, "SHARED_PREFIX_LOGPS_SELF_CHECK", True),
        token_budget=int(budget) if budget else None,
        tolerance=tuple(float(x) for x in tolerance.split(",")) if tolerance else None,
    )

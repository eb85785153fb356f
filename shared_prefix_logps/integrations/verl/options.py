"""Options of the verl plug-in, read from the environment.

verl's hook (``actor_rollout_ref.model.external_lib=shared_prefix_logps.integrations.verl``) carries a module name and
nothing else, and the module is imported in every worker process, so the options travel as environment variables
(set them in the job's runtime environment, e.g. ``ray.init(runtime_env={"env_vars": {...}})`` or verl's
``+ray_kwargs.ray_init.runtime_env.env_vars``). They are read once per engine, at its first ``forward_step``.

====================================  =======================================================================
``SHARED_PREFIX_LOGPS_MODE``          ``logps`` (default): every log-prob through the shared path; ``off``: every
                                      engine keeps verl's own code. (TRL's ``chunked`` mode does not exist here:
                                      verl's ``forward_backward_batch`` owns each micro-batch's backward.)
``SHARED_PREFIX_LOGPS_BACKEND``       completion attention: ``auto`` (default: flex on CUDA, expand elsewhere),
                                      ``expand`` or ``flex``
``SHARED_PREFIX_LOGPS_SELF_CHECK``    ``1`` (default) or ``0``: compare the first no-grad and the first grad
                                      micro-batch with verl's own ``forward_step`` and raise on mismatch
``SHARED_PREFIX_LOGPS_TOKEN_BUDGET``  no-grad calls: the most tokens forwarded at once (default: the core's)
``SHARED_PREFIX_LOGPS_TOLERANCE``     ``max_abs,mean_abs`` bounds of the self-check (default: from the dtype)
``SHARED_PREFIX_LOGPS_LOG_EVERY``     log the statistics (logger ``shared_prefix_logps.verl``, INFO) every N
                                      micro-batches per engine; 0 (default): only after each self-check
====================================  =======================================================================
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..common.backends import PLUGIN_BACKENDS

BACKENDS = PLUGIN_BACKENDS
MODES = ("logps", "off")
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
        log_every: log the statistics every this many micro-batches (0: only after each self-check).
    """

    enabled: bool = True
    backend: str = "auto"
    self_check: bool = True
    token_budget: int | None = None
    tolerance: tuple[float, float] | None = None
    log_every: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.token_budget is not None and (isinstance(self.token_budget, bool) or self.token_budget < 1):
            raise ValueError(f"token_budget must be a positive int or None, got {self.token_budget!r}")
        if self.tolerance is not None and len(self.tolerance) != 2:
            raise ValueError(f"tolerance must be (max_abs, mean_abs), got {self.tolerance!r}")
        if isinstance(self.log_every, bool) or self.log_every < 0:
            raise ValueError(f"log_every must be an int >= 0, got {self.log_every!r}")


def _mode(environ) -> bool:
    mode = environ.get("SHARED_PREFIX_LOGPS_MODE", "").strip().lower() or "logps"
    if mode == "chunked":
        raise ValueError(
            "SHARED_PREFIX_LOGPS_MODE=chunked is TRL's; verl's forward_backward_batch runs each micro-batch's "
            "backward itself. Use logps (default) or off."
        )
    if mode not in MODES:
        raise ValueError(f"SHARED_PREFIX_LOGPS_MODE must be one of {MODES}, got {mode!r}")
    return mode == "logps"


def _backend(environ) -> str:
    value = environ.get("SHARED_PREFIX_LOGPS_BACKEND", "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"SHARED_PREFIX_LOGPS_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


def _flag(environ, name: str, default: bool) -> bool:
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}, got {value!r}")


def _whole_number(environ, name: str, minimum: int) -> int | None:
    """The integer ``>= minimum`` variable ``name`` holds; None when unset."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum} written in digits (e.g. 65536), got {value!r}")
    return number


def _tolerance(environ) -> tuple[float, float] | None:
    """``(max_abs, mean_abs)`` from ``SHARED_PREFIX_LOGPS_TOLERANCE``; None when unset."""
    name = "SHARED_PREFIX_LOGPS_TOLERANCE"
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        bounds = tuple(float(part) for part in value.split(","))
    except ValueError:
        bounds = ()
    if len(bounds) != 2 or not all(math.isfinite(bound) and bound >= 0 for bound in bounds):
        raise ValueError(f"{name} must be two non-negative numbers max_abs,mean_abs (e.g. 1e-2,1e-3), got {value!r}")
    return bounds


def options_from_environment(environ=None) -> VerlOptions:
    """The options the ``SHARED_PREFIX_LOGPS*`` variables of ``environ`` (default ``os.environ``) ask for.

    Raises:
        ValueError: naming the variable and the form it accepts.
    """
    environ = os.environ if environ is None else environ
    log_every = _whole_number(environ, "SHARED_PREFIX_LOGPS_LOG_EVERY", 0)
    return VerlOptions(
        enabled=_mode(environ),
        backend=_backend(environ),
        self_check=_flag(environ, "SHARED_PREFIX_LOGPS_SELF_CHECK", True),
        token_budget=_whole_number(environ, "SHARED_PREFIX_LOGPS_TOKEN_BUDGET", 1),
        tolerance=_tolerance(environ),
        log_every=0 if log_every is None else log_every,
    )

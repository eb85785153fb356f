"""The options every environment-configured plug-in (OpenRLHF's, ms-swift's) reads the same way: ``<PREFIX>`` on or
off, ``<PREFIX>_BACKEND`` and ``<PREFIX>_SELF_CHECK``; a bad value raises a ValueError naming its variable."""

from __future__ import annotations

import os

from .backends import check_plugin_backend


def flag(name: str, default: str) -> bool:
    """Environment variable ``name`` (``default`` when unset) read as a switch: ``0``/``1``/``true``/``false``."""
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


def common_options(prefix: str) -> dict:
    """``enabled`` (``<prefix>``, default on), ``backend`` (``<prefix>_BACKEND``, default ``auto``, one of the plug-in
    backends) and ``self_check`` (``<prefix>_SELF_CHECK``, default on)."""
    backend = os.environ.get(f"{prefix}_BACKEND", "auto").strip()
    check_plugin_backend(backend, f"{prefix}_BACKEND")
    return {"enabled": flag(prefix, "1"), "backend": backend, "self_check": flag(f"{prefix}_SELF_CHECK", "1")}

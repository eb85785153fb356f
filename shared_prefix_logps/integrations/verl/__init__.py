"""verl plug-in (verl >= 0.8, FSDP engine): each prompt of a micro-batch forwarded once, installed by one config line.

```bash
python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=shared_prefix_logps.integrations.verl
```

verl imports ``external_lib`` in every worker before it builds engines; importing this module patches
``FSDPEngineWithLMHead.forward_step``, through which verl computes old-policy, reference and policy log-probs (the
critic's value-head engine is left alone). Options come from ``SHARED_PREFIX_LOGPS*`` environment variables
(:mod:`.options`). Without the hook, one engine at a time:

```python
from shared_prefix_logps.integrations.verl import patch_verl_engine, unpatch_verl_engine, get_patch

patch = patch_verl_engine(engine, backend="auto", self_check=True)
...
print(patch.stats.summary())     # or get_patch(engine).stats under the import hook
unpatch_verl_engine(engine)
```

See :mod:`.step` for what the patched step does and when it falls back to verl's own, :mod:`.install` for the
hook.
"""

from __future__ import annotations

try:
    import verl  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shared_prefix_logps.integrations.verl needs verl (pip install 'shared-prefix-logps[verl]')"
    ) from error

from ..common.self_check import SelfCheck, SelfCheckError
from ..common.stats import PatchStats
from .install import get_patch, install, installed, patch_verl_engine, uninstall, unpatch_verl_engine
from .options import VerlOptions, options_from_environment
from .step import VerlPatch

__all__ = [
    "PatchStats",
    "SelfCheck",
    "SelfCheckError",
    "VerlOptions",
    "VerlPatch",
    "get_patch",
    "install",
    "installed",
    "options_from_environment",
    "patch_verl_engine",
    "uninstall",
    "unpatch_verl_engine",
]

# The import is the installation (verl's external_lib hook); SHARED_PREFIX_LOGPS_MODE=off is honoured per engine.
install()

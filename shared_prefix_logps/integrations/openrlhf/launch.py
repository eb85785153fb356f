"""``python -m shared_prefix_logps.integrations.openrlhf.launch <train_ppo_ray arguments>``: OpenRLHF's own launcher
(``openrlhf.cli.train_ppo_ray``) with the plug-in installed in the driver and, through Ray's
``worker_process_setup_hook``, in every Ray worker (policy, reference, critic-less GRPO), OpenRLHF unedited."""

from __future__ import annotations

import functools
import runpy
import sys

from .install import install, with_setup_hook

LAUNCHER = "openrlhf.cli.train_ppo_ray"


def hooked_ray_init(ray_init):
    """``ray.init`` that adds the plug-in's setup hook (and options) to the ``runtime_env`` it is given."""

    @functools.wraps(ray_init)
    def init(*args, **kwargs):
        kwargs["runtime_env"] = with_setup_hook(kwargs.get("runtime_env"))
        return ray_init(*args, **kwargs)

    return init


def main(argv: list[str] | None = None) -> None:
    """Run OpenRLHF's PPO/GRPO launcher with ``argv`` (default: this process's arguments)."""
    import ray

    ray.init = hooked_ray_init(ray.init)
    install()
    sys.argv = [LAUNCHER, *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

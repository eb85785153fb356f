"""``python -m shared_prefix_logps.integrations.swift --plugin-path``: prints the file for ms-swift's
``--external_plugins``."""

from __future__ import annotations

import argparse

from . import plugin_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shared_prefix_logps.integrations.swift",
        description="The ms-swift plug-in: pass the printed file to `swift rlhf --rlhf_type grpo --external_plugins`.",
    )
    parser.add_argument("--plugin-path", action="store_true", help="print the plug-in file's path")
    args = parser.parse_args(argv)
    if not args.plugin_path:
        parser.print_help()
        return 2
    print(plugin_path())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

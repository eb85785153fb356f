"""ms-swift ``--external_plugins`` file of the ms-swift plug-in's command-line test: after training, writes the
plug-in's stats of the trainer to the JSON file named by ``SHARED_PREFIX_LOGPS_SWIFT_TEST_STATS``."""

import dataclasses
import json
import os

from swift.pipelines.train.sft import SwiftSft

_train = SwiftSft.train


def _train_and_dump(self, trainer):
    result = _train(self, trainer)
    from shared_prefix_logps.integrations.swift import get_patch

    patch = get_patch(trainer)
    stats = None if patch is None else dataclasses.asdict(patch.stats)
    with open(os.environ["SHARED_PREFIX_LOGPS_SWIFT_TEST_STATS"], "w") as f:
        json.dump(stats, f)
    return result


SwiftSft.train = _train_and_dump

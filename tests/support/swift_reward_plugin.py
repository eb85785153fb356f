"""ms-swift ``--external_plugins`` file of the ms-swift plug-in's tests: a reward that varies within every group of
completions of the tiny random model (its letters spread; lengths alone would not, most completions are truncated)."""

from swift.rewards import orms


class SpreadLetters:
    """The number of distinct letters of a completion minus a tenth of its length."""

    def __init__(self, args=None, **kwargs):
        pass

    def __call__(self, completions, **kwargs):
        return [float(len({c for c in text if c.isalpha()})) - 0.1 * len(text) for text in completions]


orms["spl_letters"] = SpreadLetters

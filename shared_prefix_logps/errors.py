"""Exceptions shared by the package's modules."""


class UnsupportedModelError(ValueError):
    """The model's architecture or configuration cannot be served by the shared-prefix path."""


class SharedDropoutWarning(UserWarning):
    """A call ran with dropout active (the model in training mode with dropout, attention dropout or router jitter):
    each shared prefix's random draw is shared by every row that continues it (a prompt's by its G completions),
    where full rows would draw it per row. ``model.eval()`` (or dropout 0) gives the dense path's numbers;
    ``warnings.filterwarnings("ignore", category=SharedDropoutWarning)`` accepts the shared draw silently."""

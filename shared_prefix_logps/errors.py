"""Exceptions shared by the package's modules."""


class UnsupportedModelError(ValueError):
    """The model's architecture or configuration cannot be served by the shared-prefix path."""

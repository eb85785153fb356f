"""Temporary and lasting replacement of instance attributes, undone exactly: a trainer patch replaces methods on
the trainer's (and its accelerator's) instances and must give back what each instance held, or nothing, so that
class-level attributes (and class-level patches made later, e.g. by mocks) show through again."""

from __future__ import annotations

import contextlib

_MISSING = object()


@contextlib.contextmanager
def instance_attribute(obj, name: str, value):
    """Set ``obj.name = value`` on the instance for the block; afterwards restore exactly what the instance held
    (its own attribute, or none, so that the class attribute shows through again)."""
    previous = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, previous)


def replace_attribute(obj, name: str, value, record: list) -> None:
    """Set ``obj.name = value`` on the instance, appending ``(obj, name, what the instance held)`` to ``record`` so
    that :func:`restore_attributes` can undo it."""
    record.append((obj, name, obj.__dict__.get(name, _MISSING)))
    setattr(obj, name, value)


def restore_attributes(record: list) -> None:
    """Undo :func:`replace_attribute` calls, last first: each instance gets back exactly what it held (its own
    attribute, or none, so that the class attribute shows through again)."""
    while record:
        obj, name, previous = record.pop()
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, previous)


class Unpatched:
    """Calls ``obj.name`` as it resolves without the patch, looked up at each call.

    Create it before replacing the attribute. If the instance had an attribute of its own, that one is called;
    otherwise the class's attribute as it is at call time (bound to ``obj``), so that class-level patches made after
    the plug-in was installed (e.g. ``unittest.mock.patch.object(GRPOTrainer, ...)``) still take effect.
    """

    def __init__(self, obj, name: str):
        self.obj = obj
        self.name = name
        self.held = obj.__dict__.get(name, _MISSING)

    def resolve(self):
        if self.held is not _MISSING:
            return self.held
        attribute = getattr(type(self.obj), self.name)
        bind = getattr(type(attribute), "__get__", None)  # functions bind; a plain callable (a mock) does not
        return bind(attribute, self.obj, type(self.obj)) if bind is not None else attribute

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

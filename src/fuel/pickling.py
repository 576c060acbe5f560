"""Pickling for the frozen slots dataclasses a stored program holds (``fuel.runtime.program_cache``)."""

from __future__ import annotations


def fast_pickle(cls):
    """A frozen slots dataclass pickled as the tuple of its fields, in declaration order.

    The dataclass default calls ``dataclasses.fields`` for every instance it restores: ~0.25 s
    of the ~34,000 graph, parameter and decision values two stored SmolLM2 programs hold (what a
    warm first token restores). The program cache's key (fuel's source digest) keeps a stored
    tuple from ever meeting another version of the class."""
    import dataclasses

    names = tuple(f.name for f in dataclasses.fields(cls))

    def __getstate__(self):
        return tuple(getattr(self, name) for name in names)

    def __setstate__(self, state):
        for name, value in zip(names, state):
            object.__setattr__(self, name, value)

    cls.__getstate__, cls.__setstate__ = __getstate__, __setstate__
    return cls

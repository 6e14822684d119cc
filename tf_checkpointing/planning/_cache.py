"""The planners' caches, in one registry.

Profiling runs the model, so the planners keep what they measured per chain or
model, input shapes and mode, and a later call with the same ones reuses it
(a chain planned on every call of ``checkpoint_sequential``, a model planned
for another budget). Each cache registers here; :func:`clear_caches` empties
them all (the layers they keep alive are released).
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["clear_caches", "registered"]

_caches: list[Any] = []
C = TypeVar("C")


def registered(cache: C) -> C:
    """Registers a cache (anything with ``clear()``) and returns it."""
    _caches.append(cache)
    return cache


def clear_caches() -> None:
    """Forgets every profile, measurement and plan the planners keep.

        >>> from tf_checkpointing.planning import clear_caches
        >>> clear_caches()
    """
    for cache in _caches:
        cache.clear()

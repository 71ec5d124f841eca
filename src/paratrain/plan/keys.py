"""Hashing of the planner's frozen dataclasses, which the search uses as cache keys tens
of thousands of times per search: a dataclass's generated ``__hash__`` rebuilds a tuple
of every field on each call, so the hash is computed once and kept on the instance."""

from __future__ import annotations

from dataclasses import fields


def cached_hash(obj: object) -> int:
    """``hash`` of the tuple of ``obj``'s fields, computed on first use."""
    try:
        return obj.__dict__["_hash"]
    except KeyError:
        value = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, "_hash", value)  # frozen: bypass the guard, once
        return value

"""argparse types shared by ``paratrain bench`` and the scripts in ``benchmarks/``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (steps, rounds, ranks, sizes);
    argparse names the flag in its error, and ``why`` explains the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}{why}")
        return value

    return parse


def int_list(minimum: int, why: str = "") -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers (``1,2,4``: world or pipeline sizes),
    each of at least ``minimum``; a bad item is named instead of a ValueError traceback."""
    one = at_least(minimum, why)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give comma-separated integers, e.g. 2,4; got {text!r}")
        return [one(x) for x in items]

    return parse

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

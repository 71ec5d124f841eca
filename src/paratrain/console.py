"""What paratrain says while it trains goes through ``logging`` (logger ``paratrain``):
information to stdout, warnings and errors to stderr, each message as it is.

``paratrain train`` calls ``configure`` in the launcher and in every rank, with
``--quiet`` (``[train] quiet``) keeping only warnings and errors. A library user who
drives the loop from Python configures ``logging`` as they like, or calls ``configure``;
without either, paratrain's information lines are not printed (warnings still are,
through logging's last resort).
"""

from __future__ import annotations

import logging
import sys

ROOT = "paratrain"


def get(name: str) -> logging.Logger:
    """The logger of a paratrain module (``__name__``)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


class _Console(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stdout`` / ``sys.stderr`` are when it emits
    (a test's captured streams, a redirected file), not the streams it was made with."""

    def __init__(self, errors: bool):
        super().__init__()
        self.errors = errors

    @property
    def stream(self):
        return sys.stderr if self.errors else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


def configure(quiet: bool = False) -> None:
    """Console output for paratrain's commands (idempotent): INFO to stdout unless
    ``quiet``, WARNING and above to stderr, messages unformatted."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _Console) for h in logger.handlers):
        out, err = _Console(errors=False), _Console(errors=True)
        out.addFilter(lambda record: record.levelno < logging.WARNING)
        err.setLevel(logging.WARNING)
        for handler in (out, err):
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)

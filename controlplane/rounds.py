"""The leader's loops' rounds that fail on a defect: not the store, not the
leadership, but the code (or data it did not expect).

Such a round is said once while it lasts, the first time with its traceback,
and the loop goes on. The next round may not meet it (one origin's record, one
report); and a loop that ended took the term with it (ControlPlane._lead
cancels the others), so the replica stepped down and led again in a loop,
every leader-only loop restarted each time, while one defect was the cause.
"""

from __future__ import annotations

import logging


class Defects:
    """A loop's failed rounds, said once while they last (`failed` in an
    `except Exception:` block), and said again when a round passes."""

    def __init__(self, log: logging.Logger, rounds: str) -> None:
        self._log = log
        self._rounds = rounds  # what fails, for the log: "health rounds"
        self._last = ""

    def failed(self, exc: Exception) -> None:
        """Log the round's failure `exc`: at ERROR with its traceback unless
        the round before failed alike (then at DEBUG)."""
        said = f"{type(exc).__name__}: {exc}"
        if said == self._last:
            self._log.debug("%s failed again: %s", self._rounds, said)
            return
        self._last = said
        self._log.error("%s failed, tried again each round", self._rounds, exc_info=exc)

    def passed(self) -> None:
        if self._last:
            self._last = ""
            self._log.info("%s run again", self._rounds)

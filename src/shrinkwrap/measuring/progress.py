"""Progress through work done in stages: each stage's items counted on a progress function as each
one ends, with an estimate of the time left (:class:`Stage`). A progress function is called as
``progress(i, n, text)``: ``i`` of the stage's ``n`` items done; ``shrinkwrap.ProgressBar`` draws
the calls on stderr."""

from __future__ import annotations

import time
from typing import Callable

Progress = Callable[[int, int, str], None]
clock = time.perf_counter  # what a stage's seconds are read from
SETTLED = 1.0  # seconds a stage runs before it estimates what is left: its first items may be cached rows


def seconds_text(seconds: float) -> str:
    """``8 s``, ``2 min 5 s``, ``1 h 4 min``: a duration as a person reads it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Stage:
    """One stage of ``n`` items on ``progress`` (None: nothing is said): ``progress(0, n, label)``
    as it starts, and as each item ends ``progress(i, n, "label, about 40 s left: item")``, the time
    left estimated from the seconds the items done took (the last: ``"label, 2 min 5 s in all:
    item"``). A stage whose count changes as it goes (regions left unmeasured, a search that ends
    early) says so with :meth:`recount` or :meth:`end`.

    Args:
        progress: the function told, or None.
        label: what the stage does, first in every text.
        n: how many items it counts.

    Example::

        >>> stage = Stage(lambda i, n, text: print(i, n, text), "candidates", 2)
        0 2 candidates
        >>> stage.done("swish()")  # three seconds in
        1 2 candidates, about 3 s left: swish()
    """

    def __init__(self, progress: Progress | None, label: str, n: int) -> None:
        self.progress, self.label, self.n, self.i = progress, label, max(0, n), 0
        self.started = clock()
        if progress:
            progress(0, self.n, label)

    def left(self) -> float | None:
        """The seconds the items left should take, at the mean of those done; None before one is,
        or before the stage has run :data:`SETTLED` seconds (a cached row takes none)."""
        spent = clock() - self.started
        if not self.i or spent < SETTLED:
            return None
        return spent / self.i * (self.n - self.i)

    def done(self, item: str = "") -> None:
        """One more item ended (``item``: what it was)."""
        self.i += 1
        self.n = max(self.n, self.i)
        self.say(item)

    def say(self, text: str) -> None:
        """``text`` told at the count so far, with the time left (a step of a long item)."""
        if not self.progress:
            return
        if self.i >= self.n:
            when = f"{seconds_text(clock() - self.started)} in all"
        else:
            left = self.left()
            when = None if left is None else f"about {seconds_text(left)} left"
        head = ", ".join(t for t in (self.label, when) if t)
        self.progress(self.i, self.n, f"{head}: {text}" if text else head)

    def restart(self) -> None:
        """Time the items from now on: what the stage did first (a compilation side by side before
        each plan's turn) is no guide to what each item takes."""
        self.started = clock()

    def recount(self, n: int) -> None:
        """The stage counts ``n`` items now (no fewer than are done)."""
        self.n = max(n, self.i)

    def end(self, text: str = "done") -> None:
        """The stage ends with the items done so far, where fewer than it counted ran: said once,
        as all of them (a bar ends its line)."""
        if self.i < self.n:
            self.n = self.i
            self.say(text)

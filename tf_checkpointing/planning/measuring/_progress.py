"""What planning is doing, told when it takes a while.

Planning runs the model to measure it: per layer call for a ``tf.function``
plan, and whole compiled training steps for an XLA plan, which on a large
model takes minutes. A user who sees nothing for that long cannot tell
planning from a hang. So once a planning has run :data:`FIRST_AFTER` seconds,
each measurement loop says where it is on stderr (at most every
:data:`EVERY` seconds), a single long measurement (a whole step compiled for
XLA) says when it starts, and the end says how long it took. A short planning
prints nothing. Each line starts with the public function the user called, as
the API layer set it (``planning._errors.worded``).

Example:
    >>> from tf_checkpointing.planning._errors import worded
    >>> from tf_checkpointing.planning.measuring import _progress
    >>> with worded("plan_model"), _progress.planning("`mlp`"):
    ...     for i in range(3):
    ...         _progress.step("measuring layer calls", i + 1, 3)   # quick: silent
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from typing import Optional

from tf_checkpointing.planning._errors import caller

__all__ = ["planning", "stage", "step"]

FIRST_AFTER = 5.0  # seconds of planning before the first line
EVERY = 10.0  # seconds between two lines


@dataclasses.dataclass
class _Report:
    caller: str  # the public function called
    what: str
    started: float
    last: float = 0.0
    told: bool = False
    counts: dict = dataclasses.field(default_factory=dict)  # per stage, when not given

    def say(self, text: str) -> None:
        print(f"{self.caller}: planning {self.what}: {text} "
              f"({time.monotonic() - self.started:.0f} s)", file=sys.stderr, flush=True)
        self.told = True


_lock = threading.Lock()  # the profile runs in a thread of its own
_current: Optional[_Report] = None


@contextlib.contextmanager
def planning(what: str) -> Iterator[None]:
    """The body is one planning of ``what`` for the public function called
    (``planning._errors.caller``); a planning inside another (a model's chain
    profile) is part of it."""
    global _current
    with _lock:
        outer = _current is not None
        if not outer:
            _current = _Report(caller(), what, time.monotonic())
    if outer:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            report, _current = _current, None
        if report is not None and report.told:
            report.say("done")


def step(stage: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
    """Notes that ``done`` of ``total`` (None: not known ahead) measurements of
    ``stage`` are made (``done`` None: one more than before); tells it if the
    planning has run long enough."""
    with _lock:
        report = _current
        if report is None:
            return
        if done is None:
            done = report.counts[stage] = report.counts.get(stage, 0) + 1
        now = time.monotonic()
        if now - report.started < FIRST_AFTER or now - report.last < EVERY:
            return
        report.last = now
    report.say(f"{stage} {done}" + ("" if total is None else f"/{total}"))


def stage(name: str) -> None:
    """Tells that one long measurement, ``name``, starts (if the planning has run
    long enough): compiling a whole step for XLA takes minutes and has no steps
    to count, so without this line the last one read as a hang."""
    with _lock:
        report = _current
        if report is None or time.monotonic() - report.started < FIRST_AFTER:
            return
        report.last = time.monotonic()
    report.say(name)

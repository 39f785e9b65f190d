"""Ctrl-C and SIGTERM: finish the step, save, stop (a second signal aborts)."""

from __future__ import annotations

import contextlib
import logging
import signal
import time

log = logging.getLogger(__name__)


class StopFlag:
    """Ctrl-C or SIGTERM asks the loop to save and stop after the current step; a second one aborts."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            # A launcher (torchrun) forwards the user's Ctrl-C as a SIGTERM within milliseconds: only a
            # second signal that comes later is a person asking to abort without saving.
            if time.monotonic() - self._first > 2.0:
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        self._first = time.monotonic()
        log.warning("%s received: saving a checkpoint after this step (again to abort)", self.signal)

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred():
    """Ctrl-C and SIGTERM held off (logged, not acted on) while a failing run says why: torchrun SIGTERMs the
    survivors as soon as a rank dies, which would otherwise cut that line short."""
    old = {}

    def note(signum, frame) -> None:
        log.warning("%s received while reporting the failure: finishing the report first", signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            old[sig] = signal.signal(sig, note)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)

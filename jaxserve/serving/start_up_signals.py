"""`jaxserve serve` obeys SIGINT and SIGTERM before its event loop runs.

`run_until_signal` (server.py) handles both signals on its event loop, from the warm-up to the stop. Before
that loop exists `serve` reads the plan, imports JAX, loads the weights and builds the instances (seconds;
minutes for a big checkpoint), and Python's defaults would apply: SIGTERM kills the process (status -15), and
SIGINT raises KeyboardInterrupt in the main thread wherever it happens to be, which a garbage-collector callback
(JAX registers one) or a `__del__` swallows ("Exception ignored in ...": the server goes on to serve).

`StartUpSignals.install()` covers that span. Both signals get a Python handler that does nothing, and Python's
wakeup fd (its C-level handler writes the signal's number there, from whichever thread the kernel picked) is a
socket that a watcher thread reads: on a signal it leaves at once with status 0, as a signal during the
warm-up does (nothing was served, nothing to drain), however busy the main thread is in a C call.
`hand_over()`, once the event loop's own handlers are in place, retires the watcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

log = logging.getLogger("jaxserve.serving.server")  # the server's log: its start-up and stop lines are together

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartUpSignals:
    """SIGINT and SIGTERM stop the process at once (status 0) until `hand_over()`. Main thread only."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # the wakeup fd must not block the C-level signal handler
        self._watcher = threading.Thread(target=self._watch, name="jaxserve-start-up-signals", daemon=True)

    @classmethod
    def install(cls) -> StartUpSignals:
        guard = cls()
        guard._watcher.start()
        signal.set_wakeup_fd(guard._write.fileno(), warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _ignore_here)  # the watcher acts on it; KeyboardInterrupt could be swallowed
        return guard

    def hand_over(self) -> None:
        """The event loop handles both signals now (its `add_signal_handler` replaced the wakeup fd): retire the
        watcher. A signal that reached the watcher before has ended the process already."""
        with contextlib.suppress(OSError):
            self._write.send(b"\0")  # not a signal number: the watcher's cue to return
        self._watcher.join()
        self._read.close()
        self._write.close()

    def _watch(self) -> None:
        while True:
            data = self._read.recv(64)  # signal numbers; another signal with a Python handler writes here too
            stops = [signal.Signals(b).name for b in data if b in SIGNALS]
            if stops:
                log.warning("%s during start-up (before the warm-up): stopping without serving", "+".join(stops))
                _flush_and_exit(0)
            if not data or 0 in data:
                return


def _ignore_here(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler while `StartUpSignals` watches: the watcher thread acts on the signal."""


def _flush_and_exit(status: int) -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)

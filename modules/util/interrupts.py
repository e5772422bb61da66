"""Ctrl-C as KeyboardInterrupt, whatever SIGINT handling the process inherited.

A process started in the background by a non-interactive shell (`train ... &` in a script, many job runners) begins
with SIGINT ignored, and Python then never installs its KeyboardInterrupt handler: a Ctrl-C or `kill -INT` would do
nothing. The trainer's phases that stop by KeyboardInterrupt (caching) therefore install it themselves, as the
training loop installs its own handler."""
import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_raises() -> Iterator[None]:
    """Within, SIGINT raises KeyboardInterrupt in the main thread; the handler before is put back after. Outside
    the main thread (the GUI's worker) nothing changes: that run stops through its stop request."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

"""The trainer's SIGINT handlers, installed whatever SIGINT handling the process inherited.

A process started in the background by a non-interactive shell (`train ... &` in a script, many job runners) begins
with SIGINT ignored, and Python then never installs its KeyboardInterrupt handler: a Ctrl-C or `kill -INT` would do
nothing. So the trainer installs its handlers itself: KeyboardInterrupt while caching (`interrupt_raises`), a stop
request while training. Only the main thread can; a run in another thread (the GUI's worker) stops through its stop
request."""
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


def install_sigint(handler: Callable) -> Callable | int | None:
    """Installs `handler` for SIGINT; the handler before it (to put back), or None where this is not the main
    thread and nothing was installed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def interrupt_raises() -> Iterator[None]:
    """Within, SIGINT raises KeyboardInterrupt in the main thread; the handler before is put back after."""
    previous = install_sigint(signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

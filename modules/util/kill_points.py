"""A test hook for the reliability drills (docs/reliability.md), read in this one place.

`WAN_TRAINER_KILL_AT=<phase>:<n>` makes the process kill itself with SIGKILL at the n-th kill point (1-based) of
that phase, as a power loss or the kernel's OOM killer would; `<phase>:<n>:INT` sends SIGINT instead (Ctrl-C).
Phases: `caching` (a cache entry written, not yet renamed), `step` (between backward and the optimizer step),
`backup` (a backup folder written, not yet renamed), `sample` (a preview video written, not yet renamed), `save`
(the output file written, not yet renamed). Unset (always, outside tests), every kill point is one dictionary
lookup."""
import contextlib
import os
import signal
from collections.abc import Iterator

ENVIRONMENT_VARIABLE = "WAN_TRAINER_KILL_AT"
PHASES = ("caching", "step", "backup", "sample", "save")

_current_phase: str | None = None
_counts: dict[str, int] = {}


def _target() -> tuple[str, int, int] | None:
    spec = os.environ.get(ENVIRONMENT_VARIABLE)
    if not spec:
        return None
    phase, _, rest = spec.partition(":")
    count, _, signal_name = rest.partition(":")
    if phase not in PHASES or not count.isdigit():
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={spec!r}: expected <phase>:<n>[:INT] with a phase of {PHASES}")
    return phase, int(count), signal.SIGINT if signal_name == "INT" else signal.SIGKILL


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Atomic writes inside the block are kill points of phase `name`."""
    global _current_phase
    previous, _current_phase = _current_phase, name
    try:
        yield
    finally:
        _current_phase = previous


def kill_point(name: str | None = None) -> None:
    """A point where the drills may kill the process; `name` defaults to the enclosing `phase` block's."""
    target = _target()
    name = name or _current_phase
    if target is None or name != target[0]:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == target[1]:
        os.kill(os.getpid(), target[2])

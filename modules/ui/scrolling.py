"""Which way a mouse wheel scrolls a view that scrolls both ways (the gallery's grid). Imports no toolkit."""
from __future__ import annotations

SHIFT = 0x1   # the Shift bit of a Tk event's `state`


def wheel_scroll(num: int, delta: int, state: int, platform: str) -> tuple[str, int] | None:
    """("x" or "y", units) for a wheel event, None for another button. Shift+wheel scrolls sideways, as browsers
    and file managers do. X11 reports the wheel as buttons 4 / 5, Windows and macOS as a `delta` (120 per notch
    on Windows)."""
    axis = "x" if state & SHIFT else "y"
    if num in (4, 5):
        return axis, -1 if num == 4 else 1
    if not delta:
        return None
    if platform.startswith("win"):
        notches = -int(delta / 120)
        return axis, notches or (-1 if delta > 0 else 1)
    return axis, -delta

"""The one error every unreadable input raises (the caller skips the file with one warning and counts it)."""
import os


class UnreadableMediaError(Exception):
    """A file that cannot be used: corrupt, truncated, empty, without frames, of an unsupported type or codec."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):
        return type(self), (self.path, self.reason)


def describe_error(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

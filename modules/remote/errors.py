"""The errors of remote runs: each message names the host, the file or the field, and what to do."""


class RemoteError(Exception):
    """A remote step failed; the message says which and why."""


class HostKeyError(RemoteError):
    """The host is unknown (not accepted yet) or its key changed; `fingerprint` is the key the host shows."""

    def __init__(self, message: str, host: str = "", fingerprint: str = "", changed: bool = False):
        super().__init__(message)
        self.host, self.fingerprint, self.changed = host, fingerprint, changed


class RemoteDiskFull(RemoteError):
    """The remote file system has no room for what is being written."""

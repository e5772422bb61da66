"""The errors of remote runs: each message names the host, the file or the field, and what to do."""


class RemoteError(Exception):
    """A remote step failed; the message says which and why."""


class HostKeyError(RemoteError):
    """The host is unknown (not accepted yet) or its key changed."""


class RemoteDiskFull(RemoteError):
    """The remote file system has no room for what is being written."""

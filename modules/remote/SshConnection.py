"""One SSH connection to the remote machine (paramiko: synchronous, maintained, what OneTrainer uses): commands, SFTP
and port forwards. Host keys are strict: an unknown host is refused until the user accepts its fingerprint once
(remembered in the project's own known_hosts file), a changed key is refused loudly. No password is ever asked for or
kept; a key is named by its file or comes from the SSH agent."""
from __future__ import annotations

import base64
import hashlib
import os
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from modules.remote.errors import HostKeyError, RemoteError


SFTP_TIMEOUT_S = 120.0
KEEPALIVE_S = 15
# a link that died without a word (a half-open TCP connection: the pod's network went away, a laptop slept) is
# noticed by the kernel once data sent (a keepalive) stays unacknowledged this long: the connection then fails
# instead of waiting for TCP's own retry limit (about 15 minutes)
UNACKNOWLEDGED_S = 45


@dataclass(frozen=True)
class HostAddress:
    host: str
    user: str
    port: int

    @property
    def text(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def key_name(self) -> str:
        """The host's name in known_hosts, as OpenSSH writes it (a non-default port in brackets)."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


def parse_host(text: str, default_user: str = "", default_port: int = 22) -> HostAddress:
    """user@host[:port] (an IPv6 address in brackets: user@[::1]:2222)."""
    user, _, rest = text.rpartition("@")
    port = default_port
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = _port(tail[1:], text)
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
        port = _port(port_text, text)
    else:
        host = rest
    if not host:
        raise RemoteError(f"--host {text!r}: no host name (user@host[:port])")
    return HostAddress(host, user or default_user or _local_user(), port)


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise RemoteError(f"--host {whole!r}: the port must be 1 to 65535")
    return int(text)


def _local_user() -> str:
    import getpass
    return getpass.getuser()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's form: SHA256:<base64 of the key blob's SHA-256, unpadded>."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _AcceptOnce(paramiko.MissingHostKeyPolicy):
    """An unknown host passes only when the user named its fingerprint (--accept-host-key); it is then remembered."""

    def __init__(self, known_hosts: Path, accepted: str | None):
        self.known_hosts = known_hosts
        self.accepted = accepted

    def missing_host_key(self, client, hostname, key):
        seen = fingerprint(key)
        if self.accepted is None or self.accepted.strip() != seen:
            wrong = (f" (--accept-host-key named {self.accepted.strip()!r}, not this key)"
                     if self.accepted else "")
            raise HostKeyError(
                f"{hostname} is not a known host{wrong}: its {key.get_name()} key has the fingerprint {seen}. "
                f"Compare it with the one the machine's provider shows (or `ssh-keygen -lf "
                f"/etc/ssh/ssh_host_{_short_type(key)}_key.pub` on the machine), then run again with "
                f"--accept-host-key {seen}; it is then remembered in {self.known_hosts}", hostname, seen)
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.known_hosts.with_name(self.known_hosts.name + ".tmp")
        client.get_host_keys().save(str(temporary))
        os.replace(temporary, self.known_hosts)


def _short_type(key: paramiko.PKey) -> str:
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(key.get_name(), "ecdsa")


class SshConnection:
    def __init__(self, address: HostAddress, known_hosts: str | os.PathLike, key_file: str = "",
                 accept_fingerprint: str | None = None, timeout: float = 20.0):
        self.address = address
        # the longest a command may run when run() is given no timeout, and an SFTP read may wait for its answer
        # (None: commands unbounded, SFTP reads SFTP_TIMEOUT_S); the follower bounds its own this way, so a
        # server that stopped answering on a link that still looks open cannot hold it
        self.command_timeout: float | None = None
        self.known_hosts = Path(known_hosts)
        self.key_file = key_file
        self.accept_fingerprint = accept_fingerprint
        self.timeout = timeout
        self.client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None

    def connect(self) -> "SshConnection":
        client = paramiko.SSHClient()
        if self.known_hosts.is_file():
            client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(_AcceptOnce(self.known_hosts, self.accept_fingerprint))
        if self.key_file and not Path(self.key_file).is_file():
            raise RemoteError(f"remote.key_file: {self.key_file!r} does not exist")
        try:
            client.connect(self.address.host, self.address.port, self.address.user,
                           key_filename=self.key_file or None, allow_agent=True, look_for_keys=not self.key_file,
                           timeout=self.timeout, banner_timeout=self.timeout, auth_timeout=self.timeout)
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as error:
            client.close()
            raise HostKeyError(
                f"THE HOST KEY OF {self.address.key_name} HAS CHANGED: {self.known_hosts} holds "
                f"{fingerprint(error.expected_key)}, the machine now shows {fingerprint(error.key)}. Someone may be "
                f"intercepting the connection; nothing was sent. If the machine was really reinstalled (a new pod at "
                f"the same address), remove its line from {self.known_hosts} and accept the new key",
                self.address.key_name, fingerprint(error.key), changed=True) from None
        except paramiko.PasswordRequiredException:
            client.close()
            raise RemoteError(f"remote.key_file {self.key_file!r} is encrypted: add it to the SSH agent (ssh-add) "
                              f"and leave remote.key_file empty; passwords are never asked for or kept") from None
        except paramiko.AuthenticationException as error:
            client.close()
            raise RemoteError(f"{self.address.text}: authentication failed ({error}); name a key with --key-file "
                              f"or load it into the SSH agent") from None
        except (OSError, paramiko.SSHException) as error:
            client.close()
            raise RemoteError(f"{self.address.text}: cannot connect ({error})") from None
        transport = client.get_transport()
        transport.set_keepalive(KEEPALIVE_S)
        _limit_unacknowledged(transport.sock)
        self.client = client
        return self

    @property
    def connected(self) -> bool:
        transport = self.client.get_transport() if self.client else None
        return bool(transport and transport.is_active())

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self.client.open_sftp()
            # a connection that died without a word (a half-open TCP link) must end a read, not hang it: the
            # follower then reconnects
            self._sftp.get_channel().settimeout(self.command_timeout or SFTP_TIMEOUT_S)
        return self._sftp

    def run(self, command: list[str] | str, check: bool = True, stdin: bytes | None = None,
            timeout: float | None = None) -> tuple[int, str, str]:
        """Runs one command in the remote's shell; a list is quoted word by word (shlex), so a path is only ever a
        path. Returns (exit status, stdout, stderr); check: a non-zero status raises RemoteError."""
        text = command if isinstance(command, str) else shlex.join(command)
        timeout = timeout if timeout is not None else self.command_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        channel = self.client.get_transport().open_session(timeout=self.timeout)
        channel.settimeout(timeout)
        channel.exec_command(text)
        if stdin is not None:
            channel.sendall(stdin)
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        transport = channel.get_transport()
        while True:
            if channel.recv_ready():
                out += channel.recv(65536)
            elif channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
            elif channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            elif channel.closed or not transport.is_active():
                # the connection died under the command: no exit status will come (waiting for one hangs)
                raise EOFError(f"the connection to {self.address.host} closed during `{_shorten(text)}`")
            elif deadline is not None and time.monotonic() > deadline:
                channel.close()
                raise TimeoutError(f"`{_shorten(text)}` on {self.address.host} gave no exit status within "
                                   f"{timeout:.0f} s")
            else:
                channel.status_event.wait(0.05)
        out += _drain(channel.recv, channel.recv_ready)
        err += _drain(channel.recv_stderr, channel.recv_stderr_ready)
        status = channel.recv_exit_status()
        channel.close()
        result = status, out.decode(errors="replace"), err.decode(errors="replace")
        if check and status != 0:
            raise RemoteError(f"on {self.address.host}: `{_shorten(text)}` failed (exit {status}): "
                              f"{result[2].strip() or result[1].strip()}")
        return result

    def open_session(self, command: list[str]) -> paramiko.Channel:
        """A long-lived command (a lock holder) whose channel the caller keeps."""
        channel = self.client.get_transport().open_session(timeout=self.timeout)
        channel.exec_command(shlex.join(command))
        return channel

    def close(self) -> None:
        if not self.connected:
            # a dead connection: closing its channels politely would wait on a link that carries nothing
            self._sftp = None
        if self._sftp is not None:
            try:
                self._sftp.close()
            except (OSError, EOFError):  # the connection is already gone
                pass
            self._sftp = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _limit_unacknowledged(sock) -> None:
    """TCP keepalives and a bound on unacknowledged data (Linux's TCP_USER_TIMEOUT; elsewhere the SSH keepalives
    and the read timeouts alone notice a dead link)."""
    if not isinstance(sock, socket.socket):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", KEEPALIVE_S), ("TCP_KEEPCNT", 3),
                          ("TCP_USER_TIMEOUT", UNACKNOWLEDGED_S * 1000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _drain(read, ready) -> bytes:
    data = bytearray()
    while ready():
        data += read(65536)
    return bytes(data)


def _shorten(text: str) -> str:
    return text if len(text) < 200 else text[:200] + " ..."


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

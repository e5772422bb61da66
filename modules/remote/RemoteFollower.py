"""Follows a detached remote run: prints its log as it grows, brings each preview home as it is written, and at the
end brings the workspace (its newest backup only), the run report and the output home, verified by hash. A broken
connection does not stop the run there: the follower says so and reconnects with a growing wait. One follower per
run: a lock held on the remote for as long as the follower's connection lives (a dropped connection frees it)."""
from __future__ import annotations

import posixpath
import secrets
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from modules.remote.errors import HostKeyError, RemoteError
from modules.remote.RunRecord import RunRecord
from modules.remote.transfer import _is_connection_error, fetch_file, fetch_tree
from modules.remote.hashing import remote_sha256

LOCK_PROGRAM = ("import fcntl, os, sys\n"
                "f = open(sys.argv[1], 'a')\n"
                "try:\n"
                "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                "except OSError:\n"
                "    print('busy', flush=True); sys.exit(1)\n"
                "with open(sys.argv[1] + '.holder', 'w') as holder:\n"
                "    holder.write(f'{os.getpid()} {sys.argv[2]}')\n"
                "print('held', flush=True)\n"
                "sys.stdin.read()\n")


# a command of the follower (a cat, a kill, hashing the run's files) or a file read that gets no answer within this
# is taken for a dead connection (a server that stopped answering while the link still looks open): the follower
# reconnects instead of waiting on it
ANSWER_TIMEOUT_S = 300.0
MAX_WAIT_S = 30.0


class FollowerBusy(RemoteError):
    pass


class _Detached(Exception):
    """The window closed (detach) while the follower waited to reconnect."""


class RemoteFollower:
    def __init__(self, record: RunRecord, connect: Callable[[], object], say=print, poll_s: float = 1.0,
                 give_up_s: float = 1800.0, out=None, tensorboard_port: int | None = None,
                 notify: Callable[[str, object], None] = lambda kind, value: None, first_wait_s: float = 1.0,
                 answer_timeout_s: float = ANSWER_TIMEOUT_S):
        self.record = record
        self.connect = connect
        self.say = say
        self.notify = notify   # ("preview", local path) as each comes home; ("connection", "lost" / "reconnected")
        self.poll_s = poll_s
        self.give_up_s = give_up_s
        self.first_wait_s = first_wait_s   # the first reconnect's wait; each next one doubles it, up to MAX_WAIT_S
        self.answer_timeout_s = answer_timeout_s
        self.out = out or sys.stdout
        self.connection = None
        self.lock_channel = None
        self.log_copy = record.local_folder / "train.log"
        self.stop_sent = False
        self.token = secrets.token_hex(8)   # names this follower's lock holder there
        self.tensorboard_port = tensorboard_port   # a local port for the remote's TensorBoard; None: no tunnel
        self.tensorboard_remote_port: int | None = None
        self.forward = None
        self.stop_requested = threading.Event()   # the GUI's Stop: sent from the follower's own thread
        self.detach_requested = threading.Event()

    # ---- connection, lock --------------------------------------------------------------------------------------

    def _attach(self) -> None:
        self.connection = self.connect()
        self.connection.command_timeout = self.answer_timeout_s
        lock = posixpath.join(self.record.run_dir, "follower.lock")
        channel = self._take_lock(lock)
        if channel is None and self._release_own_stale_lock(lock):
            channel = self._take_lock(lock)
        if channel is None:
            self.connection.close()
            raise FollowerBusy(f"run {self.record.run_name} on {self.record.host} is followed by another window or "
                               f"machine already; only one follower may bring its files home (close the other one "
                               f"first)")
        self.lock_channel = channel
        if self.tensorboard_port is not None:
            self._tunnel_tensorboard()

    def _take_lock(self, lock: str):
        """The channel of the lock holder there, or None when another holds the lock."""
        channel = self.connection.open_session([self.record.python, "-c", LOCK_PROGRAM, lock, self.token])
        answer, deadline = b"", time.monotonic() + 30
        while b"\n" not in answer and time.monotonic() < deadline:
            if channel.recv_ready():
                answer += channel.recv(64)
            elif channel.exit_status_ready():
                break
            elif channel.closed or not channel.get_transport().is_active():
                raise EOFError(f"the connection to {self.record.host} closed while taking the follower lock")
            else:
                time.sleep(0.02)
        if answer.strip() == b"held":
            return channel
        channel.close()
        return None

    def _release_own_stale_lock(self, lock: str) -> bool:
        """After a dropped connection the server may not have noticed yet that this follower's old session is gone,
        and its lock holder lives on: it is ended when it carries this follower's token (never another's)."""
        _, out, _ = self.connection.run(["cat", lock + ".holder"], check=False)
        pid, _, token = out.strip().partition(" ")
        if token != self.token or not pid.isdigit():
            return False
        self.connection.run(["kill", pid], check=False)
        time.sleep(0.5)
        return True

    def _tunnel_tensorboard(self) -> None:
        from modules.remote.tunnel import PortForward, start_remote_tensorboard
        if self.tensorboard_remote_port is None:
            self.tensorboard_remote_port = start_remote_tensorboard(
                self.connection, self.record.python, posixpath.join(self.record.remote_workspace, "tensorboard"),
                self.record.run_dir)
        self.forward = PortForward(self.connection, self.tensorboard_remote_port, self.tensorboard_port)
        self.tensorboard_port = self.forward.local_port   # the same port again after a reconnect
        self.say(f"remote: TensorBoard of the run: http://localhost:{self.forward.local_port}")

    def close(self) -> None:
        if self.forward is not None:
            self.forward.close()
            self.forward = None
        if self.lock_channel is not None:
            self.lock_channel.close()
            self.lock_channel = None
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def _reconnect(self, error: BaseException) -> None:
        """Connects again with a growing wait (first_wait_s, doubled each time up to MAX_WAIT_S), each attempt bounded
        by the connection's timeouts, for at most give_up_s; the run goes on there meanwhile. A host whose key
        changed is never retried."""
        host = self.record.host
        self.say(f"remote: the connection to {host} was lost ({type(error).__name__}: {error}); the run goes on "
                 f"there; reconnecting")
        self.notify("connection", "lost")
        self.close()
        delay, started, attempt = self.first_wait_s, time.monotonic(), 0
        while True:
            if self.detach_requested.wait(delay):
                raise _Detached()
            attempt += 1
            try:
                self._attach()
            except (FollowerBusy, HostKeyError):
                raise
            except Exception as again:  # noqa: BLE001  a broken connection or a refused one is retried, not the rest
                if not (isinstance(again, RemoteError) or _is_connection_error(again)):
                    raise
                self.close()
                if time.monotonic() - started > self.give_up_s:
                    raise RemoteError(f"{host} has not answered for {self.give_up_s / 60:.0f} minutes "
                                      f"({attempt} attempts; the last: {again}); the run may still go on there: "
                                      f"follow it again with\n  {self.attach_command()}") from None
                delay = min(delay * 2, MAX_WAIT_S)
                self.say(f"remote: still unreachable (attempt {attempt}: {again}); next try in {delay:.0f} s")
                continue
            self.say(f"remote: reconnected to {host} (attempt {attempt}); following on from where it was")
            self.notify("connection", "reconnected")
            return

    def attach_command(self) -> str:
        return (f"./run-cmd.sh remote attach --record {shlex.quote(str(self.record.local_folder / 'run.json'))}")

    # ---- the run's files ----------------------------------------------------------------------------------------

    def _read_log(self) -> None:
        offset = self.log_copy.stat().st_size if self.log_copy.is_file() else 0
        try:
            with self.connection.sftp.open(posixpath.join(self.record.run_dir, "train.log"), "r") as file:
                file.seek(offset)
                data = file.read()
        except FileNotFoundError:
            return
        if data:
            self.log_copy.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_copy, "ab") as copy:
                copy.write(data)
            self.out.write(data.decode(errors="replace"))
            self.out.flush()

    def _exit_status(self) -> int | None:
        try:
            with self.connection.sftp.open(posixpath.join(self.record.run_dir, "exit_status"), "r") as file:
                return int(file.read().decode().strip())
        except FileNotFoundError:
            return None

    def _fetch_previews(self) -> list[Path]:
        remote = posixpath.join(self.record.remote_workspace, "samples", self.record.run_name)
        local = Path(self.record.local_workspace) / "samples" / self.record.run_name
        written = fetch_tree(self.connection, remote, local, settled=False)
        for path in written:
            self.say(f"remote: preview home: {path}")
            self.notify("preview", path)
        return written

    def fetch_outputs(self) -> list[Path]:
        """The workspace (only the newest backup of its backups) and the output files, verified by hash."""
        workspace = self.record.remote_workspace
        _, out, _ = self.connection.run(
            f"cd {shlex.quote(workspace)} 2>/dev/null && find backup -mindepth 2 -maxdepth 2 -type d "
            f"-printf '%T@ %p\\n'", check=False)
        folders = sorted((float(line.split(" ", 1)[0]), line.split(" ", 1)[1]) for line in out.splitlines()
                         if " " in line)
        newest = folders[-1][1] + "/" if folders else None

        def skip(relative: str) -> bool:
            if relative == "training-lock.json":   # the remote trainer's lock of its own workspace
                return True
            return relative.startswith("backup/") and (newest is None or not relative.startswith(newest))

        written = fetch_tree(self.connection, workspace, Path(self.record.local_workspace), skip)
        for remote, local in self.record.outputs.items():
            digest = remote_sha256(self.connection, [remote]).get(remote)
            if digest is not None:
                local_path = Path(local)
                from modules.remote.hashing import file_sha256
                if not (local_path.is_file() and file_sha256(local_path) == digest):
                    fetch_file(self.connection, remote, local_path, digest)
                    written.append(local_path)
            else:
                written += fetch_tree(self.connection, remote, Path(local))
        return written

    def stop(self) -> None:
        """SIGINT to the trainer there, as a Ctrl-C here: it writes a backup and stops."""
        pid_file = posixpath.join(self.record.run_dir, "pid")
        self.connection.run(f"kill -INT \"$(cat {shlex.quote(pid_file)})\"", check=False)
        self.stop_sent = True
        self.say("remote: stop sent; the run writes a backup and stops (Ctrl-C again to leave it running there "
                 "and detach)")

    def _mark_ended(self, status: int) -> None:
        """Records here that the run ended and its files came home: a reattach after a restart skips it."""
        from modules.util.atomic import atomic_write_text
        atomic_write_text(self.record.local_folder / "ended", f"{status}\n")

    # ---- the loop -----------------------------------------------------------------------------------------------

    def follow(self) -> int:
        """Follows until the run ends; returns its exit status. Ctrl-C: stop the run there (a backup is written),
        a second Ctrl-C: detach, leaving it running (exit 130)."""
        try:
            try:
                self._attach()
            except Exception as error:  # noqa: BLE001  only a broken connection is retried, the rest re-raised
                if not _is_connection_error(error):
                    raise
                self._reconnect(error)
            return self._loop()
        except _Detached:
            return 130
        finally:
            self.close()

    def _loop(self) -> int:
        last_previews = 0.0
        while True:
            try:
                try:
                    self._read_log()
                    status = self._exit_status()
                    if status is not None or time.monotonic() - last_previews > 3 * self.poll_s:
                        self._fetch_previews()
                        last_previews = time.monotonic()
                    if status is not None:
                        self._read_log()
                        self.fetch_outputs()
                        self._mark_ended(status)
                        return status
                    if self.stop_requested.is_set() and not self.stop_sent:
                        self.stop()
                    if self.detach_requested.is_set():
                        return 130
                    time.sleep(self.poll_s)
                except KeyboardInterrupt:
                    if self.stop_sent:
                        self.say(f"remote: detached; run {self.record.run_name} goes on there. Follow it again "
                                 f"with\n  {self.attach_command()}")
                        return 130
                    self.stop()
            except Exception as error:  # noqa: BLE001  only a broken connection is retried, the rest re-raised
                if not _is_connection_error(error):
                    raise
                self._reconnect(error)

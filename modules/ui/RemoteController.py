"""The GUI's "Run on a remote machine": the config of the form, judged as `remote train` judges it, sent and started
on the remote named in its `remote` section, then followed, all in a worker thread. The view polls `events` (no
toolkit here; tested without a display):

  ("log", text)                       a line of the run's log or of the remote steps
  ("host_key", host, fingerprint)     an unknown host: the view asks the user, then calls start(accept=fingerprint)
  ("refused", [problems])             the config or the connection refused before anything ran
  ("run", run_name)                   the run is followed (started, or followed again): the gallery shows it
  ("preview", path)                   a preview file came home, under <workspace>/samples/<run_name>/
  ("connection", "lost" | "reconnected")   the connection dropped (the run goes on there; the follower reconnects
                                      with a growing wait, said in "log" lines) or is back
  ("ended", status)                   the run ended there (0 done, 130 stopped) and its files are home
  ("detached", run_name)              detach(): no longer followed, the run goes on there (reattach later)
  ("failed", text)                    a connection or remote failure (the run may go on there: reattach later)

A run started here and still going when the window closed is found again by `reattachable()` after a restart."""
from __future__ import annotations

import queue
import threading
from pathlib import Path

from modules.remote.errors import HostKeyError, RemoteError
from modules.remote.RunRecord import RunRecord
from modules.util.config.config_io import ConfigError


class _LineWriter:
    """A text stream for the follower's log output that puts whole lines on the events queue."""

    def __init__(self, events: queue.Queue):
        self.events, self.pending = events, ""

    def write(self, text: str) -> None:
        self.pending += text.replace("\r", "\n")
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                self.events.put(("log", line))

    def flush(self) -> None:
        pass


class RemoteController:
    def __init__(self, state, connect_timeout: float = 20.0):
        self.state = state
        self.events: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.follower = None
        self.record: RunRecord | None = None
        self.connect_timeout = connect_timeout

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, accept: str | None = None) -> list[str]:
        """Checks the form's config at once (problems returned, nothing started); then works in a thread."""
        if self.running:
            return ["a remote run is being followed already"]
        try:
            config = self.state.config()
        except ConfigError as error:
            return error.problems
        if not config.remote.host:
            return ["remote.host: empty; name the remote machine (and remote.user, remote.port, remote.key_file)"]
        self.thread = threading.Thread(target=self._launch, args=(config, accept), daemon=True, name="remote-run")
        self.thread.start()
        return []

    def reattachable(self) -> RunRecord | None:
        """The newest remote run started from the form's workspace whose files have not all come home yet."""
        workspace = self.state.get("workspace_dir") or ""
        record = RunRecord.newest(Path(workspace).expanduser().resolve()) if workspace else None
        return record if record is not None and not record.ended else None

    def reattach(self, record: RunRecord, accept: str | None = None) -> None:
        if self.running:
            return
        self.thread = threading.Thread(target=self._follow, args=(record, accept), daemon=True, name="remote-follow")
        self.thread.start()

    def stop(self) -> None:
        """As Stop does locally: the trainer there gets SIGINT, writes a backup and stops; the follower goes on
        until its files are home."""
        if self.follower is not None:
            self.follower.stop_requested.set()

    def detach(self) -> None:
        """Stops following (the window closes); the run goes on there."""
        if self.follower is not None:
            self.follower.detach_requested.set()

    # ---- the worker --------------------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        self.events.put(("log", text))

    def _launch(self, config, accept: str | None) -> None:
        from modules.remote.remote_train import address_for, check_remote_device, connector, judge_loaded, launch
        try:
            config = judge_loaded(config)
            address = address_for(config, None)
            connection = connector(address, config, None, accept)()
            try:
                check_remote_device(config, connection, self._say)
                started = launch(config, connection, address, config.remote.key_file, say=self._say,
                                 progress=False, on_bytes=None)
            finally:
                connection.close()
        except ConfigError as error:
            self.events.put(("refused", error.problems))
            return
        except HostKeyError as error:
            if error.fingerprint and not error.changed:
                self.events.put(("host_key", error.host, error.fingerprint))
            else:
                self.events.put(("refused", [str(error)]))
            return
        except RemoteError as error:
            self.events.put(("refused", [str(error)]))
            return
        self._follow(started.record, accept)

    def _follow(self, record: RunRecord, accept: str | None) -> None:
        from modules.remote.RemoteFollower import RemoteFollower
        from modules.remote.SshConnection import SshConnection, parse_host
        self.record = record

        def connect():
            return SshConnection(parse_host(record.host), record.known_hosts, record.key_file, accept,
                                 self.connect_timeout).connect()

        self.follower = RemoteFollower(record, connect, say=self._say, out=_LineWriter(self.events),
                                       notify=lambda kind, value: self.events.put((kind, value)))
        self.events.put(("run", record.run_name))
        try:
            status = self.follower.follow()
        except RemoteError as error:
            self.events.put(("failed", str(error)))
            return
        if status == 130 and self.follower.detach_requested.is_set():
            self.events.put(("detached", record.run_name))
        else:
            self.events.put(("ended", status))

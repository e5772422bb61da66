"""Shared by the remote-run tests: the real OpenSSH server (tests/sshd_server.py) as a module fixture, the demo's
arguments for `remote train` against it, and reading a RemoteController's events with a deadline."""
import sys

import pytest

from tests.sshd_server import start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


# the demo, two steps, one round of previews at the end
DEMO_VALUES = ["max_steps=2", "sampling.every_n_steps=2", "sampling.sample_before_training=false", "sampling.steps=2",
               "backup.every_n_steps=2"]


def values(settings: list[str]) -> list[str]:
    """--config-value arguments."""
    return [part for value in settings for part in ("--config-value", value)]


def remote_args(sshd, tmp_path, settings: list[str], accept: bool = True) -> list[str]:
    args = ["--preset-path", "demo tiny CPU", "--host", sshd.host, "--key-file", str(sshd.client_key)]
    args += ["--accept-host-key", sshd.host_fingerprint] if accept else []
    return args + values(settings + [f"remote.python={sys.executable}", f"remote.work_dir={tmp_path / 'there'}",
                                      f"remote.known_hosts={tmp_path / 'known_hosts'}"])


def event(controller, kinds: tuple[str, ...], timeout_s: float = 900) -> tuple:
    """The controller's next event of one of `kinds` (log lines on the way are skipped)."""
    import queue
    import time
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        try:
            event = controller.events.get(timeout=1)
        except queue.Empty:
            continue
        if event[0] in kinds:
            return event
        seen.append(event)
        assert event[0] not in ("refused", "failed"), event
    raise AssertionError(f"no {kinds} event; last: {seen[-5:]}")




class TrainerHold:
    """Pauses the remote trainer (SIGSTOP) the moment its first preview of `step` is whole (its JSON, written after
    the video), watching the remote work folder directly (the server runs on this machine): a test that waited for
    the preview to come home over SSH first could find the run already ended on a loaded machine."""

    def __init__(self, work_dir, step: int, deadline: float):
        import threading
        self.work_dir, self.step, self.deadline = work_dir, step, deadline
        self.pid: int | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import os
        import signal
        import time
        from pathlib import Path
        while time.monotonic() < self.deadline:
            if any(Path(self.work_dir).glob(f"out/**/samples/*/*/{self.step}-*.json")):
                pid_file = next(Path(self.work_dir).glob("runs/*/pid"))
                self.pid = int(pid_file.read_text())
                os.kill(self.pid, signal.SIGSTOP)
                return
            time.sleep(0.005)

    def held(self) -> int:
        """The paused trainer's pid (waits for the pause)."""
        self.thread.join(timeout=max(0.0, self.deadline - __import__("time").monotonic()))
        assert self.pid is not None, f"no preview of step {self.step} in {self.work_dir} in time"
        return self.pid

    def release(self) -> None:
        """Lets the trainer go on (SIGCONT) and stops watching: in a test's `finally`, so that a failing test never
        leaves a paused trainer behind."""
        import os
        import signal
        self.deadline = 0.0
        self.thread.join(timeout=5)
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

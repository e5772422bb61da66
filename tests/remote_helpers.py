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



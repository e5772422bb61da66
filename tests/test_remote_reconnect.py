"""A remote run whose connection drops: the run goes on there, the follower says so, reconnects with a growing wait
and follows on from where it was (its log copy whole, each preview brought home once), then brings the outputs home.
Against the real OpenSSH server of tests/sshd_server.py; the drop is the server side of the follower's connection
going away (the sshd processes serving it killed), as when a pod's SSH daemon restarts or its network cuts out, then
the server stopping to answer on a link that stays open (those processes stopped), as a network that drops packets
without a word. Every wait has a deadline: a follower that never comes back fails the test, it never holds the suite."""
import io
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from modules.remote.hashing import file_sha256
from modules.remote.RemoteFollower import RemoteFollower
from modules.remote.RunRecord import RunRecord
from tests.remote_helpers import remote_args, sshd  # noqa: F401
from tests.script_loader import load_script

# the demo, four steps, previews after steps 2 and 4: the drop comes between them
SETTINGS = ["max_steps=4", "sampling.every_n_steps=2", "sampling.sample_before_training=false", "sampling.steps=2",
            "backup.every_n_steps=4"]


def sshd_sessions(sshd) -> list[int]:
    """The processes of the server's open connections (its listener's children)."""
    listed = subprocess.run(["pgrep", "-P", str(sshd.process.pid)], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in listed.stdout.split()]


def wait_for(condition, deadline: float, what: str, said: list[str]) -> None:
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in time; the follower said:\n" + "\n".join(said[-30:])
        time.sleep(0.1)


def tree_hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_dropped_connection_is_said_the_follower_reconnects_and_brings_every_file_home_once(sshd, tmp_path,
                                                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    remote = load_script("remote")
    assert remote.main(["train", "--no-follow", *remote_args(sshd, tmp_path, SETTINGS)]) == 0
    capsys.readouterr()
    record = RunRecord.load(next((tmp_path / "workspace" / "demo" / "run" / "remote").glob("*/run.json")))
    run_dir = Path(record.run_dir)

    said: list[str] = []
    follower = RemoteFollower(record, remote.record_connector(record), say=said.append, poll_s=0.3,
                              out=io.StringIO(), give_up_s=120, answer_timeout_s=5)
    result = {}
    thread = threading.Thread(target=lambda: result.update(status=follower.follow()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    stopped_sessions: list[int] = []
    try:
        wait_for(lambda: any("preview home" in line and line.endswith(".mp4") for line in said), deadline,
                 "preview of step 2", said)
        trainer = int((run_dir / "pid").read_text())
        os.kill(trainer, signal.SIGSTOP)   # held while the connection drops: the drops land mid-run
        try:
            assert not (run_dir / "exit_status").exists()
            # 1. the connection is cut: the server's side of it goes away
            sessions = sshd_sessions(sshd)
            assert sessions   # the follower's connection
            for pid in sessions:
                os.kill(pid, signal.SIGTERM)
            wait_for(lambda: sum("reconnected" in line for line in said) == 1, time.monotonic() + 120,
                     "reconnect after the cut", said)
            # 2. the server stops answering while the link stays open (nothing tells the follower it is dead; its
            # own time limit must); the old session's lock holder lives on there and is ended by its token
            stopped_sessions = sshd_sessions(sshd)
            assert stopped_sessions
            for pid in stopped_sessions:
                os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: sum("reconnected" in line for line in said) == 2, time.monotonic() + 120,
                     "reconnect after the server stopped answering", said)
        finally:
            os.kill(trainer, signal.SIGCONT)
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "the follower did not finish:\n" + "\n".join(said[-30:])
    finally:
        follower.detach_requested.set()   # a failed test leaves no follower waiting behind it
        for pid in stopped_sessions:
            os.kill(pid, signal.SIGKILL)
    assert result.get("status") == 0, "\n".join(said[-30:])
    assert (run_dir / "exit_status").read_text().strip() == "0"   # the run went on there and finished

    lost = [line for line in said if "was lost" in line]
    assert len(lost) == 2 and all("the run goes on there; reconnecting" in line for line in lost), lost
    assert "TimeoutError" in lost[1] or "timed out" in lost[1], lost[1]
    # followed on from where it was: the log copy is the remote log, nothing read twice or skipped
    assert follower.log_copy.read_bytes() == (run_dir / "train.log").read_bytes()
    # every preview home, those of before the drop not fetched again
    home = [line.split("preview home: ", 1)[1] for line in said if "preview home: " in line]
    assert len(home) == len(set(home))
    samples_there = Path(record.remote_workspace) / "samples" / record.run_name
    samples_here = Path(record.local_workspace) / "samples" / record.run_name
    assert tree_hashes(samples_here) == tree_hashes(samples_there)
    assert sorted(p.name.split("-")[0] for p in samples_here.glob("*/*.mp4")) == ["2", "2", "4", "4"]
    assert set(home) == {str(p) for p in samples_here.rglob("*") if p.is_file()}
    for there, here in record.outputs.items():
        if Path(there).is_file():
            assert file_sha256(here) == file_sha256(there)
    assert record.ended


def next_events(controller, until: str, deadline: float) -> list[tuple]:
    """The controller's events up to and including the first of kind `until`."""
    import queue
    seen = []
    while not seen or seen[-1][0] != until:
        assert time.monotonic() < deadline, f"no {until!r} event in time; last: {seen[-10:]}"
        try:
            seen.append(controller.events.get(timeout=1))
        except queue.Empty:
            continue
        assert seen[-1][0] not in ("refused", "failed"), seen[-1]
    return seen


def test_the_gui_controller_shows_previews_as_they_come_and_a_restarted_window_follows_the_run_home(sshd, tmp_path,
                                                                                                    monkeypatch):
    import json
    import sys
    from modules.ui.RemoteController import RemoteController
    from modules.ui.SampleGallery import gallery_runs
    from modules.ui.UIState import UIState
    from modules.util.presets import resolve_preset
    monkeypatch.chdir(tmp_path)
    state = UIState(json.loads(Path(resolve_preset("demo tiny CPU")).read_text()))
    for key, value in {"max_steps": 4, "sampling.every_n_steps": 2, "sampling.sample_before_training": False,
                       "sampling.steps": 2, "backup.every_n_steps": 4, "remote.python": sys.executable,
                       "remote.work_dir": str(tmp_path / "there"), "remote.known_hosts": str(tmp_path / "kh"),
                       "remote.key_file": str(sshd.client_key), "remote.host": "127.0.0.1",
                       "remote.port": sshd.port}.items():
        state.set(key, value)

    def gallery_cells(run_name: str) -> dict:
        """What the gallery tab shows of the run: read as CtkGalleryView reads it, from the form's workspace."""
        runs = {run.name: run for run in gallery_runs(state.get("workspace_dir"))}
        return {cell.path.resolve(): cell.step for cell in runs[run_name].cells.values()} if run_name in runs else {}

    deadline = time.monotonic() + 600
    controller = RemoteController(state)
    assert controller.start(accept=sshd.host_fingerprint) == []
    trainer = None
    try:
        before = next_events(controller, "run", deadline)
        run_name = before[-1][1]
        before += next_events(controller, "preview", deadline)
        while not str(before[-1][1]).endswith(".mp4"):
            before += next_events(controller, "preview", deadline)
        first = Path(before[-1][1]).resolve()
        assert gallery_cells(run_name).get(first) == 2   # in the gallery as it arrived, the preview of step 2
        record = controller.record
        trainer = int(Path(record.run_dir, "pid").read_text())
        os.kill(trainer, signal.SIGSTOP)   # the window closes mid-run
        assert not Path(record.run_dir, "exit_status").exists()
        controller.detach()
        before += next_events(controller, "detached", deadline)
        assert before[-1] == ("detached", run_name)
        controller.thread.join(timeout=60)
        assert not controller.running and not record.ended
        os.kill(trainer, signal.SIGCONT)   # the run goes on there while no window follows it
        trainer = None

        after_restart = RemoteController(state)
        found = after_restart.reattachable()
        assert found is not None and found.run_dir == record.run_dir
        after_restart.reattach(found)
        events = next_events(after_restart, "ended", deadline)
    finally:
        if trainer is not None:
            os.kill(trainer, signal.SIGCONT)
        controller.detach()
    assert events[0] == ("run", run_name) and events[-1] == ("ended", 0)
    arrived_before = [Path(value).resolve() for kind, value in before if kind == "preview"]
    arrived = [Path(value).resolve() for kind, value in events if kind == "preview"]
    assert not set(arrived) & set(arrived_before)   # what came home before the restart is not fetched again
    assert len(set(arrived)) == len(arrived)
    cells = gallery_cells(run_name)
    assert sorted(cells.values()) == [2, 2, 4, 4]   # in the gallery: both prompts at steps 2 and 4
    assert {p for p in arrived_before + arrived if p.suffix == ".mp4"} == set(cells)
    assert {cells[p] for p in arrived if p.suffix == ".mp4"} >= {4}   # the step after the restart came home after it
    home = tmp_path / "workspace" / "demo" / "output" / "demo_lora.safetensors"
    assert file_sha256(home) == file_sha256(next(r for r, l in found.outputs.items() if Path(l) == home))
    assert after_restart.reattachable() is None   # ended, its files home: a later restart offers nothing

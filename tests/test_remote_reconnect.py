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
from tests.remote_helpers import TrainerHold, remote_args, sshd  # noqa: F401
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
    hold = TrainerHold(tmp_path / "there", step=2, deadline=time.monotonic() + 600)
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
        hold.held()   # the trainer paused since its first preview: the drops land mid-run
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
            hold.release()
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "the follower did not finish:\n" + "\n".join(said[-30:])
    finally:
        follower.detach_requested.set()   # a failed test leaves no follower waiting behind it
        hold.release()
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

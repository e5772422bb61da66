"""The GUI's side of a remote run (modules/ui/RemoteController.py, no display needed): each preview arrives in the
gallery's own listing as it comes home, and a window closed mid-run (a detach) and opened again reattaches to the run
and brings the rest home, nothing fetched twice. Against the real OpenSSH server of tests/sshd_server.py; every wait
has a deadline. In its own file so that it runs beside test_remote_reconnect.py on another worker."""
import time
from pathlib import Path

from modules.remote.hashing import file_sha256
from tests.remote_helpers import TrainerHold, sshd  # noqa: F401


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
    hold = TrainerHold(tmp_path / "there", step=2, deadline=deadline)
    controller = RemoteController(state)
    assert controller.start(accept=sshd.host_fingerprint) == []
    try:
        before = next_events(controller, "run", deadline)
        run_name = before[-1][1]
        before += next_events(controller, "preview", deadline)
        while not str(before[-1][1]).endswith(".mp4"):
            before += next_events(controller, "preview", deadline)
        first = Path(before[-1][1]).resolve()
        assert gallery_cells(run_name).get(first) == 2   # in the gallery as it arrived, the preview of step 2
        record = controller.record
        hold.held()   # the trainer paused since its first preview: the window closes mid-run
        assert not Path(record.run_dir, "exit_status").exists()
        controller.detach()
        before += next_events(controller, "detached", deadline)
        assert before[-1] == ("detached", run_name)
        controller.thread.join(timeout=60)
        assert not controller.running and not record.ended
        hold.release()   # the run goes on there while no window follows it

        after_restart = RemoteController(state)
        found = after_restart.reattachable()
        assert found is not None and found.run_dir == record.run_dir
        after_restart.reattach(found)
        events = next_events(after_restart, "ended", deadline)
    finally:
        hold.release()
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

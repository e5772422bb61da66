"""Issue 25 items 2 and 3 without a display: the loss graph's numbers from TensorBoard event files, and the sample
gallery's grid (rows samples, columns steps in step order)."""
from pathlib import Path

import pytest

from modules.ui import LossHistory as history


def test_loss_history_reads_tensorboard_events_and_a_resume_overwrites_its_steps(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "ws" / "tensorboard" / "2026-01-01_10-00-00"
    first = SummaryWriter(str(folder))            # the killed run: steps 1-5
    for step in range(1, 6):
        first.add_scalar("loss/step", 1.0, step)
        first.add_scalar("lr/group_0", 1e-4 * step, step)
    first.close()
    resumed = SummaryWriter(str(folder))          # resumed from the backup at step 3: steps 4-6 again
    for step in range(4, 7):
        resumed.add_scalar("loss/step", 0.5, step)
        resumed.add_scalar("loss/smoothed", 0.6, step)
    resumed.add_scalar("validation/loss", 0.7, 6)
    resumed.close()
    (tmp_path / "ws" / "tensorboard" / "empty").mkdir()
    assert [f.name for f in history.run_folders(tmp_path / "ws")] == ["2026-01-01_10-00-00"]
    run = history.read_run(folder)
    assert run.curves["loss"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5), (6, 0.5)]
    assert [s for s, _ in run.curves["lr"]] == [1, 2, 3, 4, 5]
    assert run.curves["validation"] == [(6, 0.699999988079071)]
    assert run.steps() == (1, 6)
    assert history.in_range(run.curves["loss"], 3, 4) == [(3, 1.0), (4, 0.5)]
    # file names need not sort in time order (writers opened in one second are told apart by a counter, '.10'
    # sorts before '.9'): the value logged last still wins
    killed, continued = sorted(folder.glob("events.out.tfevents.*"))
    killed.rename(folder / "events.out.tfevents.2.host")
    continued.rename(folder / "events.out.tfevents.1.host")
    assert history.read_run(folder).curves["loss"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5), (6, 0.5)]


def test_smoothing_and_axis_ticks():
    points = history.smoothed([(1, 2.0), (2, 2.0), (3, 2.0)], 0.9)
    assert [round(v, 9) for _, v in points] == [2.0, 2.0, 2.0]   # debiased: a constant stays itself
    assert history.nice_ticks(0, 100, 6) == [0, 20, 40, 60, 80, 100]
    assert history.nice_ticks(3, 17, 5)[0] == 5 and history.nice_ticks(3, 17, 5)[-1] == 15
    run = history.from_losses("r", [1.0, 3.0], first_step=11)
    assert run.curves["loss"] == [(11, 1.0), (12, 3.0)]


def test_gallery_rows_are_samples_and_columns_steps_in_step_order(tmp_path):
    import json

    from modules.ui.SampleGallery import gallery_runs

    run = tmp_path / "samples" / "2026-01-02_09-00-00"
    for folder in ("0-a_red_square", "1-a_blue_square", "10-late", "notes"):
        (run / folder).mkdir(parents=True)
    for step in (2, 10, 9, 100):
        (run / "0-a_red_square" / f"{step}-0.mp4").write_bytes(b"")
        (run / "0-a_red_square" / f"{step}-0.json").write_text(json.dumps({"prompt": "a red square", "seed": 7}))
    (run / "1-a_blue_square" / "10-1.mp4").write_bytes(b"")
    (run / "10-late" / "9-0.mp4").write_bytes(b"")
    (run / "notes" / "readme.txt").write_text("x")
    older = tmp_path / "samples" / "2026-01-01_09-00-00" / "0-x"
    older.mkdir(parents=True)
    (older / "1-0.mp4").write_bytes(b"")
    runs = gallery_runs(tmp_path)
    assert [r.name for r in runs] == ["2026-01-02_09-00-00", "2026-01-01_09-00-00"]   # newest first
    newest = runs[0]
    assert newest.rows == ["0-a_red_square", "1-a_blue_square", "10-late"]              # by sample index
    assert newest.steps == [2, 9, 10, 100]                                             # numbers, not strings
    cell = newest.cells[("0-a_red_square", 10)]
    assert cell.tooltip == "step 10 (epoch 1)\nseed 7\na red square"   # counted from 1, as the progress bar
    assert newest.cells[("1-a_blue_square", 10)].prompt == "a blue square"             # no sidecar: the slug
    assert ("1-a_blue_square", 2) not in newest.cells


def _trainer_smoothing(losses):
    """TrainingHooks' loss/smoothed, as an uninterrupted run logs it."""
    out, average = [], None
    for loss in losses:
        average = loss if average is None else 0.95 * average + 0.05 * loss
        out.append(average)
    return out


def test_events_are_read_incrementally_and_the_smoothed_line_runs_on_through_a_resume(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "tensorboard" / "run"
    losses = [1.0 / step for step in range(1, 26)]
    killed = SummaryWriter(str(folder))   # steps 1-20, killed after its backup at step 15
    for step in range(1, 21):
        killed.add_scalar("loss/step", losses[step - 1], step)
        killed.add_scalar("loss/smoothed", _trainer_smoothing(losses[:step])[-1], step)
    killed.flush()
    events = history.RunEvents(folder)
    assert events.read()
    first_reading = events.records_read
    assert not events.read() and events.records_read == first_reading   # nothing appended: nothing parsed
    killed.add_scalar("loss/step", 9.0, 21)
    killed.flush()
    assert events.read() and events.records_read == first_reading + 1   # only the appended record
    killed.close()
    resumed = SummaryWriter(str(folder))   # resumed from step 15: its own average starts afresh at step 16
    for step in range(16, 26):
        resumed.add_scalar("loss/step", losses[step - 1], step)
        resumed.add_scalar("loss/smoothed", _trainer_smoothing(losses[15:step])[-1], step)
    resumed.close()
    assert events.read()
    run = events.curves()
    assert [s for s, _ in run.curves["loss"]] == list(range(1, 26))
    assert run.curves["loss"][20] == (21, pytest.approx(losses[20]))   # the resumed run's step 21 replaced 9.0
    # the line runs on as one uninterrupted run's would, not from the resumed step's loss
    expected = _trainer_smoothing(losses)
    assert [v for _, v in run.curves["smoothed"]] == pytest.approx(expected, rel=1e-5)
    assert run.curves["smoothed"][15][1] > 2 * losses[15]


def test_the_follower_publishes_decimated_snapshots_of_a_run(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from modules.ui.LossFollower import COLUMNS, LossFollower, Source

    folder = tmp_path / "tensorboard" / "long"
    writer = SummaryWriter(str(folder))
    for step in range(1, 3001):
        writer.add_scalar("loss/step", 5.0 if step == 1234 else 0.1, step)
    writer.close()
    follower = LossFollower()
    follower._source = Source(folder)   # read in this thread, not the follower's
    assert follower.read_now() and follower.version == 1
    assert not follower.read_now() and follower.version == 1          # nothing new: no new snapshot
    overview = follower.snapshot.overview["loss"]
    assert len(overview) <= 2 * COLUMNS < 3000 and (1234, 5.0) in overview   # the spike is kept
    assert len(follower.snapshot.run.curves["loss"]) == 3000
    # tensorboard off: the window's own losses, until the folder has events
    own = [0.5, 0.4]
    follower._source = Source(tmp_path / "tensorboard" / "no-events", lambda: own, 11)
    assert follower.read_now() and follower.snapshot.run.curves["loss"] == [(11, 0.5), (12, 0.4)]
    own.append(0.3)
    assert follower.read_now() and follower.snapshot.run.curves["loss"][-1] == (13, 0.3)


def test_the_stack_check_is_the_mean_of_the_samples_distances_at_each_preview(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "tensorboard" / "run"
    writer = SummaryWriter(str(folder))
    for step in (1, 2, 3, 4):
        writer.add_scalar("loss/step", 0.5, step)
    for step, (a, b) in ((0, (0.2, 0.4)), (2, (0.3, 0.5)), (4, (0.6, 0.8))):
        writer.add_scalar("stack_check/0-a-red-square", a, step)
        writer.add_scalar("stack_check/1-a-blue-circle", b, step)
    writer.close()
    run = history.read_run(folder)
    assert [step for step, _ in run.curves["stack check"]] == [0, 2, 4]
    assert [value for _, value in run.curves["stack check"]] == pytest.approx([0.3, 0.4, 0.7])
    assert run.steps() == (0, 4)
    assert "stack check" not in history.read_run(tmp_path / "tensorboard" / "none").curves

"""A job owns its workspace while it lives, and its ranks do not outlive their launcher (docs/multi-gpu.md,
"Failures"; docs/reliability.md): a launcher killed with SIGKILL (multi_gpu's own, or torchrun) takes its ranks with
it, and a second job on a workspace a live job holds is refused naming that job's process. Each test failed before
the change: the orphaned ranks trained on (the rerun beside them resumed from their backups), and the second job
ran."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learning import train
from multi_gpu_runs import cli_arguments
from modules.trainer.workspace_lock import LOCK_FILE, check_workspace_free
from modules.util.config.ConfigError import ConfigError
from modules.util.demo_assets import make_t2v_dataset

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "scripts" / "train.py")
# rank 0's step bar: the ranks are past their start and train
STEP_BAR = re.compile(r"steps:\s+\d+%\|")
# the bound the ranks of a killed launcher must stop within
ORPHAN_LIMIT_S = 30
ENDLESS = 1_000_000   # max_steps of the jobs these tests kill

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    """(tiny model, six clips, a cache the tests share: the second job starts training sooner)."""
    root = tmp_path_factory.mktemp("guards")
    return tiny_model("wan2.1-t2v"), make_t2v_dataset(root / "squares", clips_per_class=1), root / "cache"


def start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def wait_until(predicate, limit: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {limit} s" + (f":\n{log.read_text()[-3000:]}" if log else ""))
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Any of its threads still runs. A zombie has ended (only its exit status waits to be collected), but the first
    thread of a killed process turns zombie while the others still end, holding its files (its lock) open."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue
    return False


def train_children(pid: int) -> list[int]:
    """The processes whose parent is `pid` and that run train.py: its ranks."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and b"train.py" in command:
            found.append(int(entry.name))
    return found


def kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("launcher", ["multi_gpu", "torchrun"])
def test_ranks_die_with_their_sigkilled_launcher_and_a_rerun_meanwhile_is_refused(launcher, setup, tmp_path):
    base, dataset, cache = setup
    # steps enough never to end within the test (it is killed): a job that ends before the rerun starts frees its
    # workspace, and the rerun then resumes from its last backup (seen once on 2 cores shared by 4 test workers)
    argv = cli_arguments(base, dataset, tmp_path, cache, [f"max_steps={ENDLESS}", "batch_size=1", "device=cpu"])
    if launcher == "multi_gpu":
        command = [sys.executable, TRAIN, *argv, "--config-value", "multi_gpu=true",
                   "--config-value", "distributed.processes=2"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN,
                   *argv]
    log = tmp_path / "launcher.log"
    process = start(command, log)
    ranks = []
    try:
        wait_until(lambda: STEP_BAR.search(log.read_text()), 240, "training", log)
        ranks = train_children(process.pid)
        assert len(ranks) == 2, ranks
        if launcher == "multi_gpu":
            # the same command resumed while the job trains: refused naming the job's rank 0, which holds the
            # workspace (before: it resumed from the live job's newest backup, and both trained the same steps)
            rerun = subprocess.run(command + ["--config-value", "backup.continue_last_backup=true"],
                                   capture_output=True, text=True, timeout=120, cwd=ROOT,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
            assert rerun.returncode == 2, rerun.stdout[-2000:] + rerun.stderr[-2000:]
            holder = re.search(r"in use by another training job: process (\d+)", rerun.stderr)
            assert holder and int(holder[1]) in ranks, rerun.stderr
            assert f"kill {holder[1]}" in rerun.stderr
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        process.wait()
        wait_until(lambda: not any(alive(pid) for pid in ranks), ORPHAN_LIMIT_S,
                   f"the ranks {ranks} stopping after their launcher was killed")
        print(f"{launcher}: both ranks ended {time.monotonic() - killed:.1f} s after the launcher was killed")
    finally:
        kill_all([process.pid, *ranks])
    # the workspace is free again: the next job takes over the dead job's lock, saying so
    check_workspace_free(tmp_path / "run")


def test_a_second_job_on_a_workspace_a_live_job_holds_is_refused_naming_it(setup, tmp_path, capsys):
    base, dataset, cache = setup
    argv = cli_arguments(base, dataset, tmp_path, cache, [f"max_steps={ENDLESS}", "batch_size=4", "device=cpu",
                                                          "backup.every_n_steps=1"])
    log = tmp_path / "first.log"
    first = start([sys.executable, TRAIN, *argv], log)
    try:
        wait_until(lambda: STEP_BAR.search(log.read_text()), 240, "training", log)
        wait_until(lambda: list((tmp_path / "run" / "backup").glob("*/step-*")), 120, "a backup", log)
        for extra in (["backup.continue_last_backup=true"], []):   # a resume (it would take the live job's backup)
            with pytest.raises(ConfigError) as refused:           # and a new run alike
                train(tmp_path, base, dataset, steps=2, overrides=extra)
            message = str(refused.value)
            assert f"is in use by another training job: process {first.pid} " in message, message
            assert f"kill {first.pid}" in message and "set another workspace_dir" in message
        assert first.poll() is None   # the refusals left the live job alone
    finally:
        first.kill()
        first.wait()
    capsys.readouterr()
    check_workspace_free(tmp_path / "run")   # its holder was killed: taken over with a line saying so
    out = capsys.readouterr().out
    assert f"took over the workspace lock {tmp_path / 'run' / LOCK_FILE} of process {first.pid} " in out, out
    check_workspace_free(tmp_path / "run")   # released by the check before: free, and not a killed holder's
    assert "took over" not in capsys.readouterr().out


# a rank in miniature: the guards of modules/util/launcher_watch.py, then a long wait
RANK = """import sys, time
sys.path.insert(0, sys.argv[1])
from modules.util import launcher_watch
if sys.argv[2] == "watchdog only":
    launcher_watch._set_parent_death_signal = lambda: None
    launcher_watch.INTERVAL_S = 0.2
launcher_watch.die_with_launcher()
print("armed", flush=True)
time.sleep(120)
"""
# a launcher in miniature: starts the rank in a session of its own, as torch's agent does, and waits
LAUNCHER = """import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:4]], start_new_session=True,
                        stdout=open(sys.argv[4], "w"), stderr=subprocess.STDOUT)
print(rank.pid, flush=True)
time.sleep(120)
"""


def test_the_watchdog_alone_stops_a_rank_whose_launcher_was_killed(tmp_path):
    # the portable guard, without Linux's parent-death signal: the rank sees its parent's pid change
    log = tmp_path / "rank.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(ROOT), "watchdog only", str(log)],
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, RANK="1"))
    rank = int(launcher.stdout.readline())
    try:
        wait_until(lambda: log.exists() and "armed" in log.read_text(), 60, "the rank's guards", log)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        wait_until(lambda: not alive(rank), 10, "the rank stopping", log)
    finally:
        kill_all([rank])
    assert f"train: rank 1: its launcher (process {launcher.pid}) is gone; stopping" in log.read_text()


def test_a_rank_whose_launcher_died_before_it_armed_its_guards_stops_at_once(tmp_path):
    # multi_gpu's launcher records its pid for its ranks: a rank whose parent is another process already (the
    # launcher died, the rank was re-parented) stops as it arms the guards
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    done = subprocess.run([sys.executable, "-c", RANK, str(ROOT), "both"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, RANK="0", WAN_TRAINER_LAUNCHER_PID=str(gone.pid)))
    assert done.returncode == 1 and "armed" not in done.stdout, done.stdout + done.stderr
    assert f"train: rank 0: its launcher (process {gone.pid}) is gone" in done.stderr


def test_the_window_refuses_a_start_on_a_held_workspace_marking_the_field(setup, tmp_path):
    # before: the run's ConfigError reached the window as "failed: ConfigError: invalid configuration:", the holder
    # only in a traceback in the log pane
    from modules.trainer.workspace_lock import lock_path
    from modules.ui.TrainController import TrainController
    from modules.ui.UIState import UIState
    from modules.util.config.config_io import config_to_dict, load_config
    from modules.util.process_lock import ProcessLock, own_record
    base, dataset, cache = setup
    config = load_config(overrides=[
        f"model.base_model_name={base}", f'data.concepts=[{{"path": "{dataset}"}}]',
        f"workspace_dir={tmp_path / 'run'}", f"cache_dir={cache}", f"output.destination={tmp_path / 'out.safetensors'}",
        "device=cpu", "max_steps=1", "tensorboard=false"])
    holder = ProcessLock(lock_path(tmp_path / "run"))
    holder.acquire(own_record(pid=4242, command="train.py --config-path other.json"))
    try:
        controller = TrainController(UIState(config_to_dict(config)), last_used=tmp_path / "last.json")
        assert controller.start() == [] and controller.wait(120)
        controller.poll_events()
    finally:
        holder.release()
    assert controller.run.status == "refused: the config has problems"
    # the problem names its field, so the window marks workspace_dir where it is shown
    marked = [problem for problem in controller.state.problems if problem.startswith("workspace_dir: ")]
    assert len(marked) == 1 and "in use by another training job: process 4242 " in marked[0], controller.state.problems
    assert "train.py --config-path other.json" in marked[0]
    assert not (tmp_path / "out.safetensors").exists()

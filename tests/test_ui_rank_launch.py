"""The training tab's multi-GPU section without a display (modules/ui/RankLaunch.py): what Start launches, the
refusals before anything is written, the layout menu, the progress read from rank 0's bar, and Stop."""
import io
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tqdm import tqdm

from modules.ui import RankLaunch as ranks
from modules.ui.TrainController import TrainController
from modules.ui.UIState import UIState
from modules.util.config.config_io import load_config

ROOT = Path(__file__).resolve().parent.parent


def config(**values):
    return load_config(overrides=[f"{key}={value}" for key, value in values.items()])


def test_more_processes_than_visible_gpus_is_refused_on_cuda_but_not_on_the_cpu():
    problems = ranks.launch_problems(config(multi_gpu="true", **{"distributed.processes": 4}), gpus=2)
    assert len(problems) == 1 and problems[0].startswith("distributed.processes: 4 processes but 2 GPU(s) visible")
    # on the CPU the ranks are processes, not cards: any number runs (gloo)
    assert ranks.launch_problems(config(multi_gpu="true", device="cpu", **{"distributed.processes": 4}), gpus=2) == []
    assert ranks.launch_problems(config(multi_gpu="true", **{"distributed.processes": 2}), gpus=2) == []
    one_card = ranks.launch_problems(config(multi_gpu="true", device="cuda:1", **{"distributed.processes": 2}), 2)
    assert one_card and one_card[0].startswith("device: cuda:1 names one GPU")
    # no GPU and no process count: said once (the trainer's own check words it the same)
    none = ranks.launch_problems(config(multi_gpu="true"), gpus=0)
    assert len(none) == 1 and none[0].startswith("multi_gpu: no GPU is visible")
    assert ranks.launch_problems(config(**{"distributed.processes": 8}), gpus=1) == []   # multi_gpu off


def test_start_refuses_before_writing_anything_and_marks_the_field(tmp_path):
    gpus = ranks.visible_gpus()   # none: no process count is refused; some: one process more than cards
    state = UIState({"workspace_dir": str(tmp_path / "ws"), "multi_gpu": True, "device": "auto",
                     "distributed": {"processes": 0 if gpus == 0 else gpus + 1}})
    controller = TrainController(state, last_used=tmp_path / "last.json", queue_path=tmp_path / "queue.json")
    problems = controller.start()
    expected = "multi_gpu: no GPU is visible" if gpus == 0 else "distributed.processes: "
    assert problems and problems[0].startswith(expected)
    assert not controller.running and not (tmp_path / "ws" / "gui-launches").exists()
    assert problems[0] in state.problems   # kept, as Start's other checks are, until the field is edited


def test_the_launch_is_train_py_on_the_saved_config_which_launches_the_ranks(tmp_path):
    state = UIState({"workspace_dir": str(tmp_path / "ws"), "multi_gpu": True, "device": "cpu",
                     "distributed": {"processes": 2}, "batch_size": 3})
    assert ranks.launches_ranks(state.config(), gpus=0)
    assert not ranks.launches_ranks(config(multi_gpu="true", **{"distributed.processes": 1}), gpus=0)
    path = ranks.write_launch_config(state.json_dict())
    assert path.parent == tmp_path / "ws" / "gui-launches"
    saved = load_config(str(path))   # what train.py reads: the same run
    assert (saved.multi_gpu, saved.distributed.processes, saved.batch_size, saved.device) == (True, 2, 3, "cpu")
    assert ranks.train_command(path, "python") == ["python", str(ROOT / "scripts" / "train.py"), "--config-path",
                                                   str(path)]
    lines = ranks.section_lines(state.config(), gpus=0)
    assert lines[0] == "0 GPU(s) visible; Start launches 2 ranks on 2 CPU processes (gloo): global batch 3 x 2 = 6"
    assert any(line.strip().startswith(".venv/bin/torchrun --nproc-per-node 2 scripts/train.py") for line in lines)
    refused = ranks.section_lines(config(multi_gpu="true", **{"distributed.processes": 3}), gpus=2)
    assert refused[-1].startswith("refused: distributed.processes: 3 processes but 2 GPU(s) visible")


def test_the_section_says_how_expert_and_context_parallel_deal_the_global_batch(tiny_model):
    """Expert parallel (A14B `both` on 2 ranks): every step trains both experts, each on a global batch of one
    rank's batch; context parallel 2: one group of 2 ranks shares one batch."""
    a14b = config(multi_gpu="true", device="cpu", expert="both", batch_size=3, **{
        "distributed.processes": 2, "model.base_model_name": tiny_model("wan2.2-t2v-a14b")})
    lines = ranks.section_lines(a14b, gpus=0)
    assert lines[0].endswith("global batch 3 x 1 = 3")
    assert lines[1].startswith("expert parallel: the high-noise expert on ranks 0-0, the low-noise expert on ranks 1-1")
    split = config(multi_gpu="true", device="cpu", batch_size=3, **{"distributed.processes": 2,
                                                                    "distributed.context_parallel": 2})
    assert ranks.section_lines(split, gpus=0)[:2] == [
        "0 GPU(s) visible; Start launches 2 ranks on 2 CPU processes (gloo): global batch 3 x 1 = 3",
        "context parallel: 1 group(s) of 2 ranks, each clip's tokens split 2 ways"]


def test_the_layout_menu_sets_the_distributed_fields_and_reads_them_back():
    state = UIState()
    assert ranks.layout_name(state) == "auto (by the memory plan)"
    for name, values in ranks.LAYOUTS.items():
        ranks.set_layout(state, name)
        assert state.problems == []
        assert ranks.layout_name(state) == name
        assert {path: state.get(path) for path in values} == values
    assert state.config().distributed.cpu_offload is True   # the last: sharded base + CPU offload


def trainer_bar(steps: int, **postfix) -> list[str]:
    """What GenericTrainer's step bar prints (its desc, unit and postfix), line by line."""
    out = io.StringIO()
    bar = tqdm(total=steps, desc="steps", unit="step", file=out, mininterval=0, ascii=False)
    for _ in range(steps):
        bar.set_postfix(**postfix, refresh=False)
        bar.update()
    bar.close()
    return [line for line in out.getvalue().replace("\r", "\n").splitlines() if line.strip()]


def test_rank_zero_step_bar_is_read_as_progress_and_other_bars_are_not():
    lines = trainer_bar(3, epoch=1, loss="0.1234")
    read = [ranks.parse_progress(line) for line in lines]
    assert read[-1] == {"step": 3, "total_steps": 3, "epoch": 1, "loss": 0.1234}
    assert ranks.parse_progress(trainer_bar(2, epoch=0, loss="-")[-1])["loss"] is None   # not read back yet
    caching = "caching EncodeText epoch 0:  33%|###3      | 1/3 [00:01<00:02,  1.42s/item]"
    assert ranks.parse_progress(caching) is None
    assert not ranks.log_worthy(caching, "") and ranks.log_worthy(caching.replace(" 33%", "100%"), "")


# a stand-in for train.py's launcher: rank 0's bar on stdout, a save line, and Ctrl-C's exit status 130
RANKS = textwrap.dedent("""
    import signal, sys, time
    from tqdm import tqdm
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("2 processes x batch_size 1: global batch 2; layout: DDP", flush=True)
    bar = tqdm(total=100, desc="steps", unit="step", file=sys.stdout, mininterval=0)
    for step in range(100):
        time.sleep(0.05)
        bar.set_postfix(epoch=0, loss="0.5", refresh=False)
        bar.update()
        if stop:
            print("\\nstopping after this step and writing a backup (Ctrl-C again to abort)", flush=True)
            sys.exit(130)
    print("saved out/lora.safetensors", flush=True)
""")


def test_the_window_follows_the_ranks_and_stop_is_ctrl_c_for_their_launcher(tmp_path):
    controller = TrainController(UIState(), last_used=tmp_path / "last.json", queue_path=tmp_path / "queue.json")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)
    controller._ranks = process
    import threading
    controller._thread = threading.Thread(target=controller._follow_ranks, args=(process, {}), daemon=True)
    controller._thread.start()
    deadline = time.monotonic() + 30
    while controller.run.step < 3 and time.monotonic() < deadline:
        controller.poll_events()
        time.sleep(0.05)
    assert controller.run.step >= 3 and controller.run.total_steps == 100 and controller.run.status == "training"
    assert controller.request("sample").startswith("sample now: not for a multi-GPU run")
    controller.stop()
    assert controller.wait(30)
    events = controller.poll_events()
    finished = [payload for kind, payload in events if kind == "finished"]
    assert finished and finished[0]["stopped"] is True
    assert controller.run.status == "stopped; backup written"
    assert controller.run.losses and controller.run.losses[-1] == 0.5


def test_a_multi_gpu_run_closed_midway_is_offered_for_resuming_with_its_launch_config(tmp_path):
    """The window remembers controller.resumable_config() when it closes during a run; for a multi-GPU launch that
    is the launch's config, whose resume (continue_last_backup on) launches the ranks again."""
    sleeper = tmp_path / "python"   # stands in for the launcher: the run is going while the window closes
    sleeper.write_text("#!/bin/sh\nexec sleep 30\n")
    sleeper.chmod(0o755)
    state = UIState({"workspace_dir": str(tmp_path / "ws"), "multi_gpu": True, "device": "cpu",
                     "distributed": {"processes": 2}})
    controller = TrainController(state, last_used=tmp_path / "last.json", queue_path=tmp_path / "queue.json")
    controller.python = str(sleeper)
    assert controller.resumable_config() == ""
    assert controller.start() == []
    try:
        path = controller.resumable_config()
        assert Path(path).parent == tmp_path / "ws" / "gui-launches"
        saved = load_config(path, overrides=["backup.continue_last_backup=true"])   # what resume_run starts
        assert saved.multi_gpu and saved.distributed.processes == 2 and saved.backup.continue_last_backup
    finally:
        controller._ranks.kill()
        controller._ranks.wait()
    assert controller.resumable_config() == ""   # ended: nothing to offer

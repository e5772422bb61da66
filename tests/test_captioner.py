"""The captioner (`run-cmd.sh caption`) on a tiny random Qwen2.5-VL built from a config: the model, tokenizer, image
processor and generation are transformers' real ones; the captions are nonsense."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from modules.util.tiny_vlm import make_tiny_qwen_vl
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen_vl"))


@pytest.fixture
def media_folder(tmp_path):
    """Two clips (9 frames, mp4 and npz), a still and a broken video."""
    from modules.util.video_frames import write_video
    rng = np.random.default_rng(0)
    write_video(tmp_path / "clip_a.mp4", rng.integers(0, 255, (9, 48, 64, 3), dtype=np.uint8), fps=16)
    np.savez(tmp_path / "clip_b.npz", frames=rng.integers(0, 255, (9, 40, 40, 3), dtype=np.uint8), fps=16)
    Image.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(tmp_path / "still.png")
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    return tmp_path


def caption(*args) -> int:
    import caption as script
    return script.main([str(a) for a in args])


def test_captions_every_item_keeps_existing_and_resumes(tiny_vlm, media_folder, caplog):
    (media_folder / "still.txt").write_text("my own caption\n")
    code = caption("--input", media_folder, "--model", tiny_vlm, "--frames", 3, "--max-new-tokens", 6,
                   "--prefix", "sks, ", "--batch-size", 2)
    assert code == 1   # the broken file was skipped and counted
    assert "broken.mp4" in caplog.text
    for stem in ("clip_a", "clip_b"):
        text = (media_folder / f"{stem}.txt").read_text()
        assert text.startswith("sks, ") and len(text.strip()) > len("sks,")
    assert (media_folder / "still.txt").read_text() == "my own caption\n"   # kept: --skip-existing is the default
    assert not (media_folder / "broken.txt").exists()

    # resumable: a run that stopped after one caption continues with the rest only
    (media_folder / "clip_b.txt").unlink()
    before = (media_folder / "clip_a.txt").stat().st_mtime_ns
    caption("--input", media_folder, "--model", tiny_vlm, "--frames", 3, "--max-new-tokens", 6, "--prefix", "sks, ")
    assert (media_folder / "clip_b.txt").read_text().startswith("sks, ")
    assert (media_folder / "clip_a.txt").stat().st_mtime_ns == before

    # --overwrite replaces them all, and greedy generation gives the same caption for the same input
    first = (media_folder / "clip_a.txt").read_text()
    caption("--input", media_folder, "--model", tiny_vlm, "--frames", 3, "--max-new-tokens", 6, "--prefix", "sks, ",
            "--overwrite")
    assert (media_folder / "still.txt").read_text() != "my own caption\n"
    assert (media_folder / "clip_a.txt").read_text() == first


def test_batched_captions_equal_single_ones(tiny_vlm, media_folder):
    from modules.captioning.QwenVLCaptioner import QwenVLCaptioner, fit_pixels
    captioner = QwenVLCaptioner(str(tiny_vlm), max_new_tokens=8)
    rng = np.random.default_rng(1)
    video = [fit_pixels(f, 112 * 112) for f in rng.integers(0, 255, (3, 64, 96, 3), dtype=np.uint8)]
    still = [Image.fromarray(rng.integers(0, 255, (80, 60, 3), dtype=np.uint8))]
    items = [(video, "Describe this video."), (still, "Describe this image.")]
    together = captioner.caption(items)
    assert together == [captioner.caption([item])[0] for item in items]


def test_refuses_a_model_it_cannot_find_offline(media_folder, capsys):
    code = caption("--input", media_folder, "--model", "someone/no-such-captioner-model")
    assert code == 2
    err = capsys.readouterr().err
    assert "someone/no-such-captioner-model" in err and "downloads are off" in err and "--allow-download" in err


def test_bad_arguments_are_reported_together(tmp_path, capsys):
    assert caption("--input", tmp_path / "missing", "--frames", 0, "--extension", "txt") == 2
    err = capsys.readouterr().err
    assert "--frames 0" in err and "--extension 'txt'" in err and "missing: not a folder" in err


def test_run_cmd_caption_runs_the_script(tiny_vlm, tmp_path):
    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "red.jpg")
    done = subprocess.run([str(ROOT / "run-cmd.sh"), "caption", "--input", str(tmp_path), "--model", str(tiny_vlm),
                           "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "red.txt").read_text().strip()
    assert "1 to caption" in done.stdout


def test_caption_controller_plans_refuses_and_runs_without_a_display(tiny_vlm, media_folder, tmp_path):
    from modules.ui.CaptionController import CaptionController
    from modules.ui.UIState import UIState

    state = UIState()
    state.list_append("data.concepts", {"path": str(tmp_path / "list.jsonl")})
    (tmp_path / "list.jsonl").write_text("")
    controller = CaptionController(state, 0)
    assert not controller.start() and "a manifest" in controller.progress.error
    state.set("data.concepts.0.path", str(media_folder))
    (media_folder / "still.txt").write_text("kept\n")
    assert controller.plan() == "4 files, 1 with a caption; 3 to caption (existing captions are kept)"
    controller.settings.model = "someone/no-such-captioner-model"
    assert controller.start()
    controller.wait(60)
    assert controller.progress.status == "refused" and "downloads are off" in controller.progress.error
    # the window's refusal names its tick box, not the command line's flag
    assert 'tick "allow downloading the model"' in controller.progress.error
    assert "--allow-download" not in controller.progress.error and "--model" not in controller.progress.error
    controller.settings.model, controller.settings.max_new_tokens = str(tiny_vlm), 4
    assert controller.start()
    controller.wait(120)
    assert controller.progress.written == 2 and len(controller.progress.skipped) == 1, controller.progress
    assert (media_folder / "still.txt").read_text() == "kept\n"
    assert (media_folder / "clip_a.txt").is_file() and (media_folder / "clip_b.txt").is_file()

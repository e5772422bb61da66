"""Every shell command of the user docs runs as written (issue 14): the fenced shell blocks of README.md's quick start
and of docs/e2v.md are extracted and run in order, on the tiny models and data the commands themselves create, in a
scratch folder that holds the project's files (so relative paths such as workspace/... land there, not in the
checkout).

`./run-cmd.sh SCRIPT ARGS` runs as `.venv/bin/python scripts/SCRIPT.py ARGS`, which is what run-cmd.sh does once the
venv exists (installing it is install.sh's business, not the docs'). Commands this test does not run are listed in
NOT_RUN with the reason; any other command is a failure, so a command added to these docs is either run here or
consciously listed."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh"}
NOT_RUN = {
    "./run-tests.sh": "runs this very suite",
    "./start-ui.sh": "opens a window (the GUI has its own tests)",
    "./install.sh": "installs the venv this test already runs in",
    "git": "the test runs in a copy of this checkout already",
    "cd": "the test runs every command in its copy of the project folder",
    "tensorboard": "a viewer that serves until it is stopped",
}


def section(markdown: str, heading: str | None) -> str:
    """The text under `heading` (any level) up to the next heading of the same or a higher level; all when None."""
    if heading is None:
        return markdown
    match = re.search(rf"^(#+)\s+{re.escape(heading)}\s*$", markdown, re.M)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}}\s", re.M).search(markdown, match.end())
    return markdown[match.end():end.start() if end else len(markdown)]


def shell_commands(markdown: str) -> list[str]:
    """The commands of the fenced shell blocks, continuation lines joined, blank and comment lines dropped."""
    commands = []
    for language, body in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", markdown, re.S | re.M):
        if language.lower() not in SHELL_LANGUAGES:
            continue
        joined = re.sub(r"[ \t]*\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def to_argv(command: str) -> tuple[list[str] | None, dict[str, str], str]:
    """(argv or None when not run, environment assignments, reason when not run)."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words, f"an empty command: {command!r}"
    if words[0] in NOT_RUN:
        return None, env, NOT_RUN[words[0]]
    if words[0] == "./run-cmd.sh":
        assert len(words) >= 2 and (ROOT / "scripts" / f"{words[1]}.py").is_file(), \
            f"{command!r}: run-cmd.sh names no script of scripts/"
        return [sys.executable, f"scripts/{words[1]}.py", *words[2:]], env, ""
    raise AssertionError(f"{command!r}: this test does not know how to run it; run it here or add it to NOT_RUN "
                         f"with the reason")


def scratch_project(folder: Path) -> Path:
    """A folder holding the project's files (links), where the docs' relative paths resolve."""
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {"workspace", ".git", "__pycache__", ".pytest_cache"}:
            (folder / entry.name).symlink_to(entry)
    return folder


def run_documented(commands: list[str], cwd: Path) -> list[tuple[str, str]]:
    """Runs each command in order; returns the (command, reason) pairs not run."""
    not_run = []
    for command in commands:
        argv, env, reason = to_argv(command)
        if argv is None:
            not_run.append((command, reason))
            continue
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env={**ENV, **env})
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return not_run


def test_the_extractor_reads_fenced_shell_blocks_only():
    markdown = ("# T\n## Quick start\n```bash\n./run-cmd.sh train --a \"x y\"  # note\n./run-tests.sh\n```\n"
                "```json\n{\"a\": 1}\n```\n```\ndataset/\n```\n## Next\n```sh\n./run-cmd.sh sample --b 1 \\\n"
                "    --c 2\n```\n")
    assert shell_commands(section(markdown, "Quick start")) == ['./run-cmd.sh train --a "x y"  # note',
                                                               "./run-tests.sh"]
    assert shell_commands(markdown)[-1] == "./run-cmd.sh sample --b 1 --c 2"
    argv, env, _ = to_argv('WAN_TRAINER_PLATFORM=cpu ./run-cmd.sh train --a "x y"  # note')
    assert argv[1:] == ["scripts/train.py", "--a", "x y"] and env == {"WAN_TRAINER_PLATFORM": "cpu"}
    assert to_argv("./run-tests.sh -k x")[0] is None
    with pytest.raises(AssertionError, match="does not know"):
        to_argv("rm -rf workspace")


def test_readme_quick_start_runs_as_written(tmp_path, demo_model):
    commands = shell_commands(section((ROOT / "README.md").read_text(encoding="utf-8"), "Quick start"))
    assert any(c.startswith("./run-cmd.sh train") for c in commands), commands
    cwd = scratch_project(tmp_path / "project")
    # the demo model its first use makes: the session's (tests/test_demo_model.py proves what it draws)
    shutil.copytree(demo_model, cwd / "workspace" / "demo" / "tiny-wan2.1-t2v")
    not_run = run_documented(commands, cwd)
    assert all(reason for _, reason in not_run)
    assert (cwd / "workspace" / "demo" / "output" / "demo_lora.safetensors").is_file()   # what the README promises


def test_e2v_worked_example_runs_as_written(tmp_path):
    commands = shell_commands((ROOT / "docs" / "e2v.md").read_text(encoding="utf-8"))
    assert [c.split()[1] for c in commands] == ["make_tiny_model", "make_tiny_model", "make_demo_dataset", "train",
                                                "sample"], commands
    cwd = scratch_project(tmp_path / "project")
    assert run_documented(commands, cwd) == []
    assert (cwd / "workspace" / "e2v" / "out" / "e2v_lora.safetensors").is_file()
    assert len(list((cwd / "workspace" / "e2v" / "samples").glob("*.mp4"))) == 1

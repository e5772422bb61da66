"""The project on the remote at this checkout's exact state: a `git archive` of the work tree as git sees it (HEAD plus
uncommitted changes and new files that .gitignore does not exclude, written as a tree through a temporary index, so
the checkout's own index, stash and branches stay untouched), unpacked
into `<work_dir>/project/<tree hash>` and installed there by the same install.sh. A folder whose stamp names the
same tree is reused as it is. Nothing is fetched from the internet by this code (install.sh installs the
requirements there as it does here)."""
from __future__ import annotations

import posixpath
import shlex
import subprocess
from pathlib import Path

from modules.remote.errors import RemoteError

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".remote-project-tree"


def _git(*arguments: str, text: bool = True, env: dict | None = None):
    import os
    result = subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=text, check=False,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        error = result.stderr if text else result.stderr.decode(errors="replace")
        raise RemoteError(f"git {' '.join(arguments)} in {ROOT} failed: {error.strip()} (a remote run sends the "
                          f"project as a git archive of this checkout)")
    return result.stdout


def snapshot_tree() -> str:
    """The tree of the work tree as it is now (tracked and new files, .gitignore respected)."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        env = {"GIT_INDEX_FILE": str(Path(folder) / "index")}
        _git("read-tree", "HEAD", env=env)
        _git("add", "-A", env=env)
        # a venv linked in (a worktree's .venv -> the main checkout's) is not matched by .gitignore's `.venv/`
        _git("rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", ".venv", env=env)
        return _git("write-tree", env=env).strip()


def ensure_project(connection, work_dir: str, python: str = "", say=print) -> tuple[str, str]:
    """(the project folder, its Python) on the remote, unpacked and installed when this tree is not there yet."""
    tree = snapshot_tree()
    folder = posixpath.join(work_dir, "project", tree[:20])
    stamp = posixpath.join(folder, STAMP)
    _, there, _ = connection.run(["cat", stamp], check=False)
    interpreter = python or posixpath.join(folder, ".venv", "bin", "python")
    if there.strip() == tree:
        say(f"remote: project {tree[:12]} is installed there already")
        return folder, interpreter
    archive = _git("archive", "--format=tar", tree, text=False)
    say(f"remote: sending the project ({len(archive) / 2**20:.1f} MiB, tree {tree[:12]})")
    connection.run(f"mkdir -p -- {shlex.quote(folder)} && tar -x -C {shlex.quote(folder)}", stdin=archive)
    if python:
        status, out, err = connection.run([python, "-c", "import torch, diffusers, paramiko"], check=False)
        if status != 0:
            raise RemoteError(f"remote.python {python!r} on {connection.address.host} cannot import the project's "
                              f"requirements: {(err or out).strip().splitlines()[-1:]}; leave remote.python empty "
                              f"to install them with install.sh")
        say(f"remote: using the provisioned Python {python}")
    else:
        say("remote: installing the project's requirements there with install.sh (minutes, once per version)")
        status, out, err = connection.run(f"cd {shlex.quote(folder)} && ./install.sh", check=False)
        if status != 0:
            tail = "\n".join((out + err).strip().splitlines()[-15:])
            raise RemoteError(f"install.sh failed on {connection.address.host} (exit {status}):\n{tail}")
    connection.run(f"printf %s {shlex.quote(tree)} > {shlex.quote(stamp)}")
    return folder, interpreter

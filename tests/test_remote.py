"""Remote runs over SSH against a real OpenSSH server on 127.0.0.1 (tests/sshd_server.py): the "remote" is this
machine, its work folder a temporary one, its Python this venv's (remote.python, as on a pre-provisioned host)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from modules.remote.errors import HostKeyError, RemoteDiskFull, RemoteError
from modules.remote.hashing import file_sha256
from modules.remote.SshConnection import SshConnection, parse_host
from modules.remote.transfer import FileToSend, Uploader
from tests.script_loader import load_script
from tests.remote_helpers import DEMO_VALUES, event as _event, remote_args as _remote_args, sshd  # noqa: F401
from tests.remote_helpers import values as _values
from tests.sshd_server import start_sshd


def accepted(sshd, tmp_path) -> Path:
    known_hosts = tmp_path / "known_hosts"
    SshConnection(parse_host(sshd.host), known_hosts, str(sshd.client_key), sshd.host_fingerprint).connect().close()
    return known_hosts


def connect(sshd, known_hosts) -> SshConnection:
    return SshConnection(parse_host(sshd.host), known_hosts, str(sshd.client_key)).connect()


# ---- host keys ------------------------------------------------------------------------------------------------------

def test_unknown_host_refused_until_its_fingerprint_is_accepted_and_a_changed_key_refused(sshd, tmp_path):
    known_hosts = tmp_path / "ws" / "known_hosts"
    address = parse_host(sshd.host)
    with pytest.raises(HostKeyError, match="not a known host") as refused:
        SshConnection(address, known_hosts, str(sshd.client_key)).connect()
    assert sshd.host_fingerprint in str(refused.value)   # ssh-keygen's fingerprint: the one the user compares
    assert not known_hosts.exists()
    with pytest.raises(HostKeyError, match="not this key"):
        SshConnection(address, known_hosts, str(sshd.client_key), "SHA256:" + "A" * 43).connect()
    SshConnection(address, known_hosts, str(sshd.client_key), sshd.host_fingerprint).connect().close()
    assert f"[127.0.0.1]:{sshd.port}" in known_hosts.read_text()
    connect(sshd, known_hosts).close()   # remembered: no --accept-host-key needed again

    other = start_sshd(tmp_path / "other", sshd.client_key)   # the "same address" with a new host key
    try:
        known_hosts.write_text(known_hosts.read_text().replace(f":{sshd.port}]", f":{other.port}]")
                               .replace(f"]:{sshd.port}", f"]:{other.port}"))
        with pytest.raises(HostKeyError, match="HAS CHANGED") as changed:
            SshConnection(parse_host(other.host), known_hosts, str(sshd.client_key), other.host_fingerprint).connect()
        assert other.host_fingerprint in str(changed.value) and sshd.host_fingerprint in str(changed.value)
    finally:
        other.stop()


# ---- uploads --------------------------------------------------------------------------------------------------------

def _file(path: Path, size: int, seed: int) -> Path:
    import random
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def _item(local: Path, remote: str) -> FileToSend:
    return FileToSend(local, remote, local.stat().st_size, file_sha256(local))


def _cut_after(connection, limit: int):
    def on_bytes(sent: int) -> None:
        if sent >= limit:
            # the network goes away mid-file, a moment after the last writes left (pipelined writes are not
            # acknowledged one by one: what was on the wire when the link broke is on the disk there)
            import time
            time.sleep(1.0)
            connection.client.get_transport().sock.close()
    return on_bytes


def test_cut_upload_resumes_with_the_rest_a_changed_file_is_sent_again_and_a_tampered_partial_is_caught(sshd,
                                                                                                        tmp_path):
    known_hosts = accepted(sshd, tmp_path)
    local = _file(tmp_path / "here" / "a'; rm -rf x" / "clip.bin", 3 << 20, 0)
    small = _file(tmp_path / "here" / "small.bin", 1000, 1)
    remote_root = tmp_path / "there"
    (tmp_path / "x").mkdir()
    manifest = str(remote_root / "files" / ".manifest.json")
    remote = str(remote_root / "files" / "a'; rm -rf x" / "clip.bin")
    items = [_item(small, str(remote_root / "files" / "small.bin")), _item(local, remote)]

    connection = connect(sshd, known_hosts)
    with pytest.raises(RemoteError, match="continues where it stopped"):
        Uploader(connection, manifest, progress=False, on_bytes=_cut_after(connection, 1 << 20)).send(items)
    connection.close()
    partial = Path(remote + ".partial")
    kept = partial.stat().st_size
    assert 0 < kept < local.stat().st_size

    connection = connect(sshd, known_hosts)
    report = Uploader(connection, manifest, progress=False).send(items)
    # the small file was written whole before the cut, but not yet verified and renamed: its partial is kept too
    assert report.resumed == {items[0].remote: 1000, remote: kept}
    assert report.bytes_sent == local.stat().st_size - kept   # only the rest went over the wire
    assert file_sha256(remote) == file_sha256(local) and not partial.exists()
    assert (tmp_path / "x").is_dir()   # the folder's name was only ever a name

    again = Uploader(connection, manifest, progress=False).send(items)
    assert again.sent == [] and again.bytes_sent == 0 and again.already_there == 2

    _file(small, 1000, 2)   # changed here: same size, other bytes
    changed = Uploader(connection, manifest, progress=False).send([_item(small, items[0].remote),
                                                                    items[1]])
    assert changed.sent == [items[0].remote] and changed.bytes_sent == 1000
    assert file_sha256(items[0].remote) == file_sha256(small)

    _file(local, 3 << 20, 3)
    with pytest.raises(RemoteError):
        Uploader(connection, manifest, progress=False, on_bytes=_cut_after(connection, 1 << 20)).send(
            [_item(local, remote)])
    connection.close()
    kept = partial.stat().st_size
    with open(partial, "r+b") as file:   # the partial is damaged there; its size still looks right
        file.write(b"\0" * 16)
    connection = connect(sshd, known_hosts)
    said = []
    report = Uploader(connection, manifest, progress=False, say=said.append).send([_item(local, remote)])
    connection.close()
    assert report.restarted == [remote] and report.resumed == {}
    assert report.bytes_sent == local.stat().st_size and kept < local.stat().st_size
    assert file_sha256(remote) == file_sha256(local)
    assert any("does not match" in line for line in said)


def test_a_full_remote_disk_is_named_before_anything_is_sent(sshd, tmp_path):
    known_hosts = accepted(sshd, tmp_path)
    connection = connect(sshd, known_hosts)
    free = int(subprocess.run(["df", "-Pk", str(tmp_path)], capture_output=True, text=True).stdout
               .splitlines()[-1].split()[3]) * 1024
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as file:   # sparse: larger than the disk's free space, without filling it
        file.truncate(free + (1 << 30))
    item = FileToSend(huge, str(tmp_path / "there" / "huge.bin"), huge.stat().st_size, "0" * 64)
    with pytest.raises(RemoteDiskFull, match="remote disk full"):
        Uploader(connection, str(tmp_path / "there" / ".manifest.json"), progress=False).send([item])
    connection.close()
    assert not (tmp_path / "there" / "huge.bin.partial").exists()


# ---- runs -----------------------------------------------------------------------------------------------------------

def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def _follow_until_it_prints(record: Path, text: str, timeout_s: float = 600) -> subprocess.Popen:
    """`remote attach` in its own process, returned once its output shows `text`."""
    import time
    process = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "scripts" / "remote.py"), "attach",
                                "--record", str(record)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.set_blocking(process.stdout.fileno(), False)
    seen, deadline = b"", time.monotonic() + timeout_s
    while text.encode() not in seen:
        assert process.poll() is None, seen.decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
        seen += process.stdout.read() or b""
        time.sleep(0.2)
    return process


def test_demo_on_the_remote_equals_the_local_run_and_a_second_run_sends_only_its_config(sshd, tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    remote = load_script("remote")
    from modules.remote.remote_train import judge_config
    judge_config(None, "demo tiny CPU", [])   # makes the demo model and squares here
    shutil.copytree(tmp_path / "workspace" / "demo" / "squares", tmp_path / "a'; rm -rf x")
    (tmp_path / "x").mkdir()
    values = DEMO_VALUES + ["demo_assets=false", """data.concepts=[{"name": "squares", "path": "a'; rm -rf x"}]"""]

    local = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "scripts" / "train.py"), "--preset-path", "demo tiny CPU",
         *_values(values + [f"workspace_dir={tmp_path / 'local'}", f"cache_dir={tmp_path / 'local-cache'}",
                            f"output.destination={tmp_path / 'local' / 'lora.safetensors'}"])],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert local.returncode == 0, local.stderr[-3000:]

    assert remote.main(["train", *_remote_args(sshd, tmp_path, values)]) == 0
    said = capsys.readouterr().out
    home = tmp_path / "workspace" / "demo" / "output" / "demo_lora.safetensors"
    here, there = _tensors(tmp_path / "local" / "lora.safetensors"), _tensors(home)
    assert here.keys() == there.keys() and all(torch_equal(here[k], there[k]) for k in here)
    previews = sorted((tmp_path / "workspace" / "demo" / "run" / "samples").glob("*/*/2-*.mp4"))
    assert len(previews) == 2, said[-3000:]   # both prompts' previews of step 2, brought home
    assert "preview home" in said
    assert (tmp_path / "x").is_dir()

    # the second run: a changed learning rate; the project and every file are there already
    assert remote.main(["train", "--no-follow", *_remote_args(sshd, tmp_path, values + [
        "optimizer.learning_rate=0.02"], accept=False)]) == 0
    said = capsys.readouterr().out
    assert "sent 0 files (0.00 MiB)" in said and "installed there already" in said
    record = sorted((tmp_path / "workspace" / "demo" / "run" / "remote").glob("*/run.json"),
                    key=lambda p: p.stat().st_mtime)[-1]

    # its follower's connection goes away mid-run; a second follower is refused while the first holds the run
    first = _follow_until_it_prints(record, "steps:")
    assert remote.main(["attach", "--record", str(record)]) == 1
    assert "followed by another" in capsys.readouterr().err
    first.kill()
    first.wait()
    assert remote.main(["attach", "--record", str(record)]) == 0   # the run went on there; its files come home
    run = json.loads(record.read_text())
    output = Path(run["outputs"][next(iter(run["outputs"]))])
    assert file_sha256(output) == file_sha256(next(iter(run["outputs"])))
    second = _tensors(output)
    assert any(not torch_equal(second[key], here[key]) for key in here)   # the second run's result came home

    key_lines = [line for line in sshd.client_key.read_text().splitlines() if "PRIVATE KEY" not in line]
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:
        text = path.read_bytes()
        assert not any(line.encode() in text for line in key_lines), f"{path} holds the private key"


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


def test_a_run_that_dies_there_shows_its_last_log_lines_and_the_resume_command(sshd, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    remote = load_script("remote")
    assert remote.main(["train", "--no-follow", *_remote_args(sshd, tmp_path, DEMO_VALUES)]) == 0
    capsys.readouterr()
    record = next((tmp_path / "workspace" / "demo" / "run" / "remote").glob("*/run.json"))
    run_dir = Path(json.loads(record.read_text())["run_dir"])
    import time
    deadline = time.monotonic() + 300
    while not (run_dir / "train.log").stat().st_size and time.monotonic() < deadline:
        time.sleep(0.2)   # killed once it has begun to write
    os.kill(int((run_dir / "pid").read_text()), 9)   # killed there (out of memory, a preempted pod)
    assert remote.main(["attach", "--record", str(record)]) == 137
    err = capsys.readouterr().err
    assert "failed there (exit 137)" in err and "its last log lines" in err
    assert "run-cmd.sh remote train --preset-path" in err and "backup.continue_last_backup=true" in err and "run_name=" in err


def test_the_gui_controller_asks_for_the_host_key_runs_there_and_follows_again_after_a_restart(sshd, tmp_path,
                                                                                                monkeypatch):
    from modules.ui.RemoteController import RemoteController
    from modules.ui.UIState import UIState
    from modules.util.presets import resolve_preset
    monkeypatch.chdir(tmp_path)
    state = UIState(json.loads(Path(resolve_preset("demo tiny CPU")).read_text()))
    for key, value in {"max_steps": 1, "sampling.samples_file": "", "remote.python": sys.executable,
                       "remote.work_dir": str(tmp_path / "there"), "remote.known_hosts": str(tmp_path / "kh"),
                       "remote.key_file": str(sshd.client_key)}.items():
        state.set(key, value)
    controller = RemoteController(state)
    assert any(p.startswith("remote.host") for p in controller.start())   # nothing to connect to yet
    state.set("remote.host", "127.0.0.1")
    state.set("remote.port", sshd.port)
    assert controller.start() == []
    _, host, fingerprint = _event(controller, ("host_key",))
    assert fingerprint == sshd.host_fingerprint and host == f"[127.0.0.1]:{sshd.port}"
    controller.thread.join()
    assert controller.start(accept=fingerprint) == []
    assert _event(controller, ("ended",)) == ("ended", 0)
    home = tmp_path / "workspace" / "demo" / "output" / "demo_lora.safetensors"
    assert home.is_file()

    after_restart = RemoteController(state)
    assert after_restart.reattachable() is None   # ended, and its files are home
    record = controller.record
    (record.local_folder / "ended").unlink()      # the window closed before they came home
    home.unlink()
    found = after_restart.reattachable()
    assert found is not None and found.run_dir == record.run_dir
    after_restart.reattach(found)
    assert _event(after_restart, ("ended",)) == ("ended", 0)
    assert home.is_file()


def test_a_port_on_the_remote_loopback_is_reached_through_the_tunnel(sshd, tmp_path):
    import time
    import urllib.request
    from modules.remote.tunnel import PortForward
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "hello.txt").write_text("from the remote")
    connection = connect(sshd, accepted(sshd, tmp_path))
    _, out, _ = connection.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                                "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"])
    port = int(out)
    server = connection.open_session(["sh", "-c", 'echo $$; exec "$@"', "sh", sys.executable, "-m", "http.server",
                                      "--bind", "127.0.0.1", "--directory", str(tmp_path / "served"), str(port)])
    server_pid = int(server.makefile("r").readline())
    forward = PortForward(connection, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{forward.local_port}/hello.txt", timeout=5) as page:
                    assert page.read() == b"from the remote"
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
    finally:
        forward.close()
        os.kill(server_pid, 15)
        server.close()
        connection.close()


def test_stop_sends_the_run_a_ctrl_c_and_its_backup_comes_home(sshd, tmp_path, monkeypatch, capsys):
    import time
    monkeypatch.chdir(tmp_path)
    remote = load_script("remote")
    values = ["max_steps=400", "sampling.samples_file=", "backup.every_n_steps=1000"]
    assert remote.main(["train", "--no-follow", *_remote_args(sshd, tmp_path, values)]) == 0
    record = next((tmp_path / "workspace" / "demo" / "run" / "remote").glob("*/run.json"))
    log = Path(json.loads(record.read_text())["run_dir"]) / "train.log"
    deadline = time.monotonic() + 600
    while "steps:" not in log.read_text(errors="replace"):   # the training loop runs (its Ctrl-C handler is set)
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert remote.main(["stop", "--record", str(record)]) == 0
    assert remote.main(["attach", "--record", str(record)]) == 130
    out = capsys.readouterr().out
    assert "stopping after this step and writing a backup" in out   # the trainer's own Ctrl-C answer, there
    backups = list((tmp_path / "workspace" / "demo" / "run" / "backup").glob("*/step-*"))
    assert len(backups) == 1 and any(backups[0].iterdir())   # written at the stop, and brought home
    assert "backup.continue_last_backup=true" in out

"""Remote runs over SSH against a real OpenSSH server on 127.0.0.1 (tests/sshd_server.py): the "remote" is this
machine, its work folder a temporary one, its Python this venv's (remote.python, as on a pre-provisioned host)."""
import subprocess
import sys
from pathlib import Path

import pytest

from modules.remote.errors import HostKeyError, RemoteDiskFull, RemoteError
from modules.remote.hashing import file_sha256
from modules.remote.SshConnection import SshConnection, parse_host
from modules.remote.transfer import FileToSend, Uploader
from tests.script_loader import load_script
from tests.sshd_server import start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


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

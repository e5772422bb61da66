"""Sending files to the remote and bringing files home, by content hash.

Upload: a manifest on the remote (`<work_dir>/files/.manifest.json`) records each file's SHA-256 with the size and
mtime it had when it was verified; a file whose manifest entry still matches is not sent again. A file is written
as `<name>.partial` and renamed once its remote hash equals the local one. An interrupted upload continues from the
partial file only when the hash of its bytes equals the hash of as many local bytes: a size alone is never trusted
(a partial written by another program, or damaged, is sent again from the start).

Download: every file comes home through a temporary file, is hashed, and replaces the local file only when its hash
equals the remote's."""
from __future__ import annotations

import json
import os
import posixpath
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from modules.remote.errors import RemoteDiskFull, RemoteError
from modules.remote.hashing import file_sha256, remote_sha256, remote_tree_sha256

BLOCK = 1 << 18
CONNECTION_ERRORS = (OSError, EOFError)
# partial files hashed there per command: fewer round trips for a dataset of many small files
VERIFY_BATCH, VERIFY_BYTES = 200, 1 << 30


@dataclass(frozen=True)
class FileToSend:
    local: Path
    remote: str
    size: int
    sha256: str


@dataclass
class UploadReport:
    sent: list[str] = field(default_factory=list)          # remote paths written
    bytes_sent: int = 0
    resumed: dict[str, int] = field(default_factory=dict)  # remote path -> bytes already there
    restarted: list[str] = field(default_factory=list)     # partial files that did not match and were sent again
    already_there: int = 0


def _is_connection_error(error: BaseException) -> bool:
    import paramiko
    return isinstance(error, CONNECTION_ERRORS + (paramiko.SSHException,))


class Uploader:
    def __init__(self, connection, manifest_path: str, progress: bool = True,
                 on_bytes: Callable[[int], None] | None = None, say=print):
        self.connection = connection
        self.manifest_path = manifest_path
        self.progress = progress
        self.on_bytes = on_bytes   # called with the bytes sent so far (the GUI's progress)
        self.say = say

    # ---- the remote manifest -------------------------------------------------------------------------------------

    def read_manifest(self) -> dict:
        try:
            with self.connection.sftp.open(self.manifest_path, "r") as file:
                data = json.loads(file.read().decode())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_manifest(self, manifest: dict) -> None:
        temporary = self.manifest_path + ".tmp"
        with self.connection.sftp.open(temporary, "w") as file:
            file.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        self.connection.sftp.posix_rename(temporary, self.manifest_path)

    # ---- planning ------------------------------------------------------------------------------------------------

    def missing(self, files: list[FileToSend], manifest: dict) -> list[FileToSend]:
        """The files the remote lacks: no entry, another hash, or a file that changed there since it was verified.
        A file already there whose entry is lost (an upload cut before the manifest was written) is hashed there
        and kept when it matches."""
        sftp = self.connection.sftp
        unsure, missing = [], []
        for item in files:
            entry = manifest.get(item.remote)
            try:
                stat = sftp.stat(item.remote)
            except OSError:
                missing.append(item)
                continue
            if (isinstance(entry, dict) and entry.get("sha256") == item.sha256 and entry.get("size") == stat.st_size
                    and entry.get("mtime") == stat.st_mtime):
                continue
            if stat.st_size == item.size:
                unsure.append((item, stat))
            else:
                missing.append(item)
        if unsure:
            there = remote_sha256(self.connection, [item.remote for item, _ in unsure])
            for item, stat in unsure:
                if there.get(item.remote) == item.sha256:
                    manifest[item.remote] = {"sha256": item.sha256, "size": stat.st_size, "mtime": stat.st_mtime}
                else:
                    missing.append(item)
        return missing

    # ---- sending -------------------------------------------------------------------------------------------------

    def send(self, files: list[FileToSend]) -> UploadReport:
        report = UploadReport()
        manifest = self.read_manifest()
        todo = self.missing(files, manifest)
        report.already_there = len(files) - len(todo)
        if not todo:
            self.write_manifest(manifest)
            return report
        self._check_room(todo)
        folders = sorted({posixpath.dirname(item.remote) for item in todo})
        self.connection.run("mkdir -p -- " + " ".join(shlex.quote(f) for f in folders))
        total = sum(item.size for item in todo)
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="upload", disable=not self.progress,
                   dynamic_ncols=True)
        pending: list[FileToSend] = []
        try:
            for item in todo:
                self._write_partial(item, report, bar)
                pending.append(item)
                if len(pending) >= VERIFY_BATCH or sum(p.size for p in pending) > VERIFY_BYTES:
                    self._verify(pending, manifest, report)
                    pending = []
            self._verify(pending, manifest, report)
        except RemoteError:
            raise
        except Exception as error:
            if not _is_connection_error(error):
                raise
            raise RemoteError(f"the connection to {self.connection.address.host} broke during the upload ({error}); "
                              f"run the same command again: the upload continues where it stopped") from None
        finally:
            bar.close()
        return report

    def _verify(self, items: list[FileToSend], manifest: dict, report: UploadReport) -> None:
        """Hashes the written partial files there in one command; each that matches is renamed into place and
        recorded (the manifest is written after each batch, so a cut upload keeps what was verified)."""
        if not items:
            return
        there = remote_sha256(self.connection, [item.remote + ".partial" for item in items])
        for item in items:
            partial = item.remote + ".partial"
            if there.get(partial) != item.sha256:
                self.connection.run(["rm", "-f", "--", partial], check=False)
                raise RemoteError(f"upload: {item.local} arrived as {partial} with SHA-256 {there.get(partial)}, not "
                                  f"{item.sha256} (the file changed while it was sent, or the remote disk damaged "
                                  f"it); run again")
            self.connection.sftp.posix_rename(partial, item.remote)
            stat = self.connection.sftp.stat(item.remote)
            manifest[item.remote] = {"sha256": item.sha256, "size": stat.st_size, "mtime": stat.st_mtime}
            report.sent.append(item.remote)
        self.write_manifest(manifest)

    def _resume_offset(self, item: FileToSend, partial: str, report: UploadReport) -> int:
        try:
            size = self.connection.sftp.stat(partial).st_size
        except OSError:
            return 0
        if 0 < size <= item.size:
            there = remote_sha256(self.connection, [partial]).get(partial)
            if there is not None and there == file_sha256(item.local, limit=size):
                report.resumed[item.remote] = size
                return size
        report.restarted.append(item.remote)
        self.say(f"upload: the partial file {partial} does not match the first {size} bytes of {item.local} "
                 f"(changed or damaged): sending it again from the start")
        return 0

    def _write_partial(self, item: FileToSend, report: UploadReport, bar) -> None:
        partial = item.remote + ".partial"
        offset = self._resume_offset(item, partial, report)
        bar.update(offset)
        try:
            with open(item.local, "rb") as source, self.connection.sftp.open(partial, "r+b" if offset else "wb") as out:
                out.set_pipelined(True)
                out.seek(offset)
                source.seek(offset)
                while True:
                    block = source.read(BLOCK)
                    if not block:
                        break
                    out.write(block)
                    report.bytes_sent += len(block)
                    bar.update(len(block))
                    if self.on_bytes:
                        self.on_bytes(report.bytes_sent)
        except OSError as error:
            if not _is_connection_error(error) or not self.connection.connected:
                raise
            self._name_full_disk(item, error)
            raise

    def _check_room(self, todo: list[FileToSend]) -> None:
        need = sum(item.size for item in todo)
        folder = posixpath.dirname(self.manifest_path)
        free = remote_free_bytes(self.connection, folder)
        if free is not None and free < need:
            raise RemoteDiskFull(f"remote disk full: {len(todo)} files need {need / 2**30:.2f} GiB in {folder} on "
                                 f"{self.connection.address.host}, {free / 2**30:.2f} GiB free there; free space or "
                                 f"set remote.work_dir on a larger volume")

    def _name_full_disk(self, item: FileToSend, error: OSError) -> None:
        free = remote_free_bytes(self.connection, posixpath.dirname(item.remote))
        if free is not None and free < BLOCK * 4:
            raise RemoteDiskFull(f"remote disk full while writing {item.remote} on {self.connection.address.host} "
                                 f"({free} bytes free): free space there and run again (the upload continues)") \
                from error


def remote_free_bytes(connection, folder: str) -> int | None:
    _, out, _ = connection.run(f"mkdir -p -- {shlex.quote(folder)} && df -Pk -- {shlex.quote(folder)}", check=False)
    lines = out.strip().splitlines()
    try:
        return int(lines[-1].split()[3]) * 1024
    except (IndexError, ValueError):
        return None


def fetch_tree(connection, remote_folder: str, local_folder: Path, skip: Callable[[str], bool] = lambda _: False,
               settled: bool = True) -> list[Path]:
    """Brings home every file under remote_folder that is missing here or differs, each verified by hash; returns
    the files written. The trainer's temporaries (atomic writes under way) are never fetched. `settled` False: the
    run is still writing, so a file that changes while it is read is left for the next round instead of failing."""
    from modules.util.atomic import is_temporary
    written = []
    for relative, digest in sorted(remote_tree_sha256(connection, remote_folder).items()):
        if skip(relative) or is_temporary(posixpath.basename(relative)):
            continue
        local = local_folder / relative
        if local.is_file() and file_sha256(local) == digest:
            continue
        try:
            fetch_file(connection, posixpath.join(remote_folder, relative), local, digest)
        except (RemoteError, FileNotFoundError):
            if settled:
                raise
            continue
        written.append(local)
    return written


def fetch_file(connection, remote: str, local: Path, digest: str) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    temporary = local.with_name(f".{local.name}.remote-tmp")
    connection.sftp.get(remote, str(temporary))
    got = file_sha256(temporary)
    if got != digest:
        temporary.unlink(missing_ok=True)
        raise RemoteError(f"{remote} came home with SHA-256 {got}, not the remote's {digest} (it changed while it "
                          f"was read); attach again to fetch it")
    os.replace(temporary, local)

"""A real OpenSSH server for the remote-run tests: `sshd -D` as the current user on 127.0.0.1 at a free port, with
its own host key and one authorised client key, all in a temporary folder. The "remote" is this machine. Needs
Debian's openssh-server (run-tests.sh installs it when it can); without it the tests skip and say why."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    folder: Path
    client_key: Path
    host_fingerprint: str
    process: subprocess.Popen

    @property
    def host(self) -> str:
        import getpass
        return f"{getpass.getuser()}@127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)], check=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_sshd(folder: Path, client_key: Path | None = None) -> Sshd:
    if not Path(SSHD).is_file() or shutil.which("ssh-keygen") is None:
        pytest.skip("no OpenSSH server here (apt-get install openssh-server; run-tests.sh does it when it can)")
    folder.mkdir(parents=True, exist_ok=True)
    _keygen(folder / "host_key")
    if client_key is None:
        client_key = folder / "client_key"
        _keygen(client_key)
    shutil.copy(client_key.with_suffix(".pub"), folder / "authorized_keys")
    if os.geteuid() == 0:
        # sshd started by root insists on its privilege separation folder (the package's service makes it at boot)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    port = _free_port()
    config = folder / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {folder / 'host_key'}
AuthorizedKeysFile {folder / 'authorized_keys'}
PidFile {folder / 'sshd.pid'}
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
AllowTcpForwarding yes
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    log = open(folder / "sshd.log", "wb")
    process = subprocess.Popen([SSHD, "-f", str(config), "-D", "-e"], stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"sshd exited: {(folder / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    listed = subprocess.run(["ssh-keygen", "-lf", str(folder / "host_key.pub")], capture_output=True, text=True,
                            check=True).stdout.split()
    return Sshd(port, folder, client_key, listed[1], process)

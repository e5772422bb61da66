"""`remote train`: the config is judged here exactly as `train` judges it (exit 2 before anything is sent), checked
against the remote's GPU by the memory planner, the project and the missing files are sent, and the run starts
there detached; RemoteFollower then follows it."""
from __future__ import annotations

import posixpath
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from modules.remote.errors import RemoteError
from modules.remote.RunRecord import RunRecord
from modules.remote.SshConnection import HostAddress, SshConnection, parse_host
from modules.util.config.config_io import ConfigError


def judge_config(config_path: str | None, preset_path: str | None, values: list[str]):
    """The config as `train` would run it, or ConfigError with every problem. The device is judged against the
    remote's GPUs (check_remote_device), not this machine's."""
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    preset = resolve_preset(preset_path) if preset_path else None
    return judge_loaded(load_config(config_path, preset, values))


def judge_loaded(config):
    """judge_config for a config already loaded (the GUI's)."""
    from modules.trainer.distributed import config_problems
    from modules.trainer.prepare import prepare_config
    problems = [p for p in config_problems(config) if not p.startswith("device:")]
    try:
        prepare_config(config)
    except ConfigError as error:
        raise ConfigError([p for p in error.problems if not p.startswith("device:")] + problems, error.source) \
            from None
    if problems:
        raise ConfigError(problems)
    return config


def address_for(config, host_text: str | None) -> HostAddress:
    remote = config.remote
    if host_text:
        return parse_host(host_text, remote.user, remote.port)
    if not remote.host:
        raise ConfigError(["remote.host: empty; name the machine with --host user@host[:port] or remote.host"])
    return HostAddress(remote.host, remote.user or parse_host(remote.host).user, remote.port)


def connector(address: HostAddress, config, key_file: str | None = None, accept: str | None = None):
    """A function that opens a new connection (the follower calls it again to reconnect)."""
    key = key_file if key_file is not None else config.remote.key_file
    known_hosts = str(Path(config.remote.known_hosts).expanduser().resolve())

    def connect() -> SshConnection:
        return SshConnection(address, known_hosts, key, accept).connect()
    return connect


def check_remote_device(config, connection, say=print) -> None:
    """The memory planner against the remote's first GPU; a CUDA device named where the remote has none is a config
    error."""
    from modules.planner.memory_plan import PlanError
    from modules.planner.plan_command import check_fits_device
    from modules.remote.gpu_query import query_gpus
    gpus = query_gpus(connection)
    host = connection.address.host
    if not gpus:
        say(f"remote: {host} has no GPU (neither nvidia-smi nor rocm-smi answers there): the run uses its CPU")
        if config.device.startswith("cuda"):
            raise ConfigError([f"device: {config.device!r}, but {host} has no GPU (nvidia-smi and rocm-smi find "
                               f"none); use auto or cpu"])
        return
    for name, free, total in gpus:
        say(f"remote: GPU {name}, {free:.1f} of {total:.1f} GiB free")
    if config.device == "cpu":
        return
    try:
        check_fits_device(config, "cuda", gpus[0][1], out=say)
    except PlanError as error:
        raise ConfigError([f"memory plan for {host}'s {gpus[0][0]}: {error}"]) from None


def remote_work_dir(connection, work_dir: str) -> str:
    """The absolute remote work folder (a relative one is under the remote user's home), created."""
    _, out, _ = connection.run(["sh", "-c", 'cd && mkdir -p -- "$1" && cd -- "$1" && pwd -P', "sh", work_dir])
    return out.strip()


@dataclass
class Launch:
    record: RunRecord
    upload: object   # transfer.UploadReport
    project_dir: str


def launch(config, connection, address: HostAddress, key_file: str, resume_command: str = "", say=print,
           progress: bool = True, on_bytes=None) -> Launch:
    """Sends what the remote lacks and starts the run there, detached. `config` is the judged config (not
    changed)."""
    from modules.remote.hashing import LocalHashes
    from modules.remote.project_copy import ensure_project
    from modules.remote.remote_paths import RemoteLayout, files_to_send, relocate
    from modules.remote.transfer import Uploader
    from modules.util.config.config_io import config_to_dict
    import json
    layout = RemoteLayout(remote_work_dir(connection, config.remote.work_dir))
    project_dir, python = ensure_project(connection, layout.work_dir, config.remote.python, say)
    remote_config = config.model_copy(deep=True)
    if not remote_config.run_name:
        remote_config.run_name = time.strftime("%Y-%m-%d_%H-%M-%S")
    local_workspace = Path(config.workspace_dir).expanduser().resolve()
    relocation = relocate(remote_config, layout)
    hashes = LocalHashes(local_workspace / "remote" / "local_hashes.json")
    files = files_to_send(relocation, hashes)
    hashes.save()
    say(f"remote: {len(files)} input files ({sum(f.size for f in files) / 2**20:.1f} MiB); sending what "
        f"{address.host} lacks")
    report = Uploader(connection, layout.manifest, progress, on_bytes, say).send(files)
    say(f"remote: sent {len(report.sent)} files ({report.bytes_sent / 2**20:.2f} MiB), {report.already_there} "
        f"already there")
    launch_id = f"{remote_config.run_name}-{secrets.token_hex(3)}"
    if resume_command:
        resume_command += " " + shlex.join(["--config-value", f"run_name={remote_config.run_name}"])
    run_dir = layout.run_dir(launch_id)
    connection.run(["mkdir", "-p", "--", run_dir])
    config_file = posixpath.join(run_dir, "config.json")
    with connection.sftp.open(config_file + ".tmp", "w") as file:
        data = config_to_dict(remote_config)
        data.pop("remote", None)   # the connection's settings are this side's
        file.write((json.dumps(data, indent=4) + "\n").encode())
    connection.sftp.posix_rename(config_file + ".tmp", config_file)
    outputs = {remote: str(local) for field, (local, remote) in relocation.outputs.items()
               if field not in ("workspace_dir", "cache_dir")}
    record = RunRecord(launch_id=launch_id, run_name=remote_config.run_name, host=address.text, key_file=key_file,
                       known_hosts=str(Path(config.remote.known_hosts).expanduser().resolve()),
                       work_dir=layout.work_dir, run_dir=run_dir, python=python,
                       remote_workspace=relocation.outputs["workspace_dir"][1],
                       local_workspace=str(local_workspace), outputs=outputs, resume_command=resume_command)
    record.save()
    start = (f"cd {shlex.quote(project_dir)} && setsid nohup {shlex.quote(python)} -m modules.remote.supervisor "
             f"{shlex.quote(run_dir)} -- {shlex.quote(python)} scripts/train.py --config-path "
             f"{shlex.quote(config_file)} > {shlex.quote(posixpath.join(run_dir, 'supervisor.log'))} 2>&1 < /dev/null &")
    connection.run(start)
    _wait_started(connection, run_dir)
    say(f"remote: run {remote_config.run_name} started on {address.host} in {run_dir}")
    return Launch(record, report, project_dir)


def _wait_started(connection, run_dir: str, timeout_s: float = 60.0) -> None:
    """Until the supervisor has started the trainer (its pid written), or RemoteError with what it said."""
    deadline = time.monotonic() + timeout_s
    names = [posixpath.join(run_dir, name) for name in ("pid", "exit_status")]
    while time.monotonic() < deadline:
        for name in names:
            try:
                connection.sftp.stat(name)
                return
            except FileNotFoundError:
                pass
        status, out, _ = connection.run(["cat", posixpath.join(run_dir, "supervisor.log")], check=False)
        if out.strip():
            raise RemoteError(f"the run did not start on {connection.address.host}: {out.strip()[-2000:]}")
        time.sleep(0.3)
    raise RemoteError(f"the run did not start on {connection.address.host} within {timeout_s:.0f} s (no {names[0]})")

"""Trains on another machine over SSH (a rented GPU pod): the config is judged here, the project and the files the
remote lacks are sent, the run starts there detached and is followed here (log, previews, outputs). docs/remote.md.

  remote.py train --preset-path "demo tiny CPU" --host me@pod.example.com:2222 --key-file ~/.ssh/pod
  remote.py attach [--record WORKSPACE/remote/ID/run.json | --config-path C.json]   follow a run again
  remote.py stop   [--record ... | --config-path C.json]                            Ctrl-C there: backup, stop
Exit codes: the remote run's own (0 done, 130 stopped), 2 configuration error (nothing sent), 1 connection or
remote failure.
"""
import argparse
import shlex
import sys

import _bootstrap  # noqa: F401

from modules.util.config.config_io import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "judge the config, send what is missing, start the run there and follow it"),
                       ("attach", "follow a run that was started before (running or finished)"),
                       ("stop", "stop a run there as Ctrl-C does (a backup is written)")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--config-path", help="a training config JSON")
        sub.add_argument("--preset-path", help="a preset: a file, or the name of a shipped one")
        sub.add_argument("--config-value", action="append", default=[], metavar="DOTTED.KEY=VALUE")
        sub.add_argument("--host", help="user@host[:port] (remote.host, remote.user, remote.port)")
        sub.add_argument("--key-file", help="a private key file (remote.key_file); default: the SSH agent")
        sub.add_argument("--accept-host-key", metavar="FINGERPRINT",
                         help="accept an unknown host whose key has this fingerprint (SHA256:...), once")
        if name != "stop":
            sub.add_argument("--tensorboard", nargs="?", type=int, const=0, metavar="LOCAL_PORT",
                             help="start TensorBoard there and show it here through the SSH connection at "
                                  "localhost:LOCAL_PORT (default: a free port; the URL is printed)")
        if name == "train":
            sub.add_argument("--no-follow", action="store_true", help="start the run and return (attach later)")
        else:
            sub.add_argument("--record", help="the run's record, <workspace>/remote/<id>/run.json; default: the "
                                              "newest in the config's workspace")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from modules.remote.errors import RemoteError
    try:
        if args.command == "train":
            return _train(args, argv)
        return _attach(args)
    except ConfigError as error:
        print(f"remote: {error}", file=sys.stderr)
        return 2
    except RemoteError as error:
        print(f"remote: {error}", file=sys.stderr)
        return 1


def _train(args, argv: list[str]) -> int:
    from modules.remote.remote_train import address_for, check_remote_device, connector, judge_config, launch
    config = judge_config(args.config_path, args.preset_path, args.config_value)
    address = address_for(config, args.host)
    key_file = args.key_file if args.key_file is not None else config.remote.key_file
    connection = connector(address, config, key_file, args.accept_host_key)()
    try:
        check_remote_device(config, connection)
        started = launch(config, connection, address, key_file, resume_command(argv, config))
    finally:
        connection.close()
    if args.no_follow:
        print(f"remote: follow it with ./run-cmd.sh remote attach --record "
              f"{shlex.quote(str(started.record.local_folder / 'run.json'))}")
        return 0
    return _follow(started.record, None, args.tensorboard)


def _record(args):
    from modules.remote.RunRecord import RunRecord
    from modules.remote.errors import RemoteError
    if args.record:
        return RunRecord.load(args.record)
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    config = load_config(args.config_path, resolve_preset(args.preset_path) if args.preset_path else None,
                         args.config_value)
    from pathlib import Path
    record = RunRecord.newest(Path(config.workspace_dir).expanduser().resolve())
    if record is None:
        raise RemoteError(f"no remote run was started from the workspace {config.workspace_dir} (no "
                          f"remote/*/run.json there); name one with --record")
    return record


def _attach(args) -> int:
    record = _record(args)
    if args.host or args.key_file is not None:
        from modules.remote.SshConnection import parse_host
        if args.host:
            record.host = parse_host(args.host).text
        if args.key_file is not None:
            record.key_file = args.key_file
    if args.command == "stop":
        from modules.remote.RemoteFollower import RemoteFollower
        follower = RemoteFollower(record, record_connector(record, args.accept_host_key))
        follower.connection = follower.connect()
        try:
            follower.stop()
        finally:
            follower.close()
        return 0
    return _follow(record, args.accept_host_key, args.tensorboard)


def record_connector(record, accept: str | None = None):
    from modules.remote.SshConnection import SshConnection, parse_host

    def connect():
        return SshConnection(parse_host(record.host), record.known_hosts, record.key_file, accept).connect()
    return connect


def _follow(record, accept: str | None = None, tensorboard: int | None = None) -> int:
    from modules.remote.RemoteFollower import RemoteFollower
    follower = RemoteFollower(record, record_connector(record, accept), tensorboard_port=tensorboard)
    status = follower.follow()
    if status == 0:
        print(f"remote: run {record.run_name} finished; its workspace and outputs are home, verified by hash "
              f"({record.local_workspace})")
    elif status == 130:
        print(f"remote: run {record.run_name} stopped; its newest backup is home. To resume it there:\n  "
              f"{record.resume_command}")
    else:
        print(f"remote: run {record.run_name} failed there (exit {status}); its last log lines:", file=sys.stderr)
        print("\n".join(_tail(follower.log_copy, 20)) or "  (its log is empty: it died as it started)", file=sys.stderr)
        print(f"to resume from its last backup:\n  {record.resume_command}", file=sys.stderr)
    return status


def _tail(path, count: int) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-count:]
    except OSError:
        return []


def resume_command(argv: list[str], config) -> str:
    """`remote train` again, continuing the run's last backup there (launch adds the run's name)."""
    import os
    from pathlib import Path
    arguments = [a for a in argv if a != "--no-follow"]
    arguments += ["--config-value", "backup.continue_last_backup=true"]
    script = Path(__file__).resolve().parent.parent / "run-cmd.sh"
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join([str(script), 'remote', *arguments])}"


if __name__ == "__main__":
    sys.exit(main())

"""The training job queue (the GUI's "Add to queue" uses the same file). Exit codes: 0 success, 2 a bad command or
config, or another runner (the window, another `queue run`) already running the queue, 1 a job failed (`run`: the
queue still ran every job). A job's config is checked when it is added, as `train` checks it before loading, and
again when it runs.

  run-cmd.sh queue add C.json [C2.json ...]   a job per complete config file (as a run writes to run-configs/)
  run-cmd.sh queue list
  run-cmd.sh queue run                         every waiting job in order, one model in memory at a time
  run-cmd.sh queue remove N                    the job numbered N in `list`
  run-cmd.sh queue pause N                     a waiting job is skipped by `run` until paused again (resumed)
  run-cmd.sh queue move N M                    the job numbered N becomes number M
  every command: --queue FILE          (default: workspace/queue/queue.json)
"""
import argparse
import sys

import _bootstrap  # noqa: F401

from modules.ui.JobQueue import DEFAULT_QUEUE, JobQueue, QueueBusy, describe, train_config_file
from modules.util.config.config_io import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run-cmd.sh queue", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--queue", default=str(DEFAULT_QUEUE), help=f"the queue file (default: {DEFAULT_QUEUE})")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", parents=[common], help="add config files as jobs")
    add.add_argument("configs", nargs="+", metavar="CONFIG.json")
    commands.add_parser("list", parents=[common], help="list the jobs")
    commands.add_parser("run", parents=[common], help="run the waiting jobs in order")
    remove = commands.add_parser("remove", parents=[common], help="remove a job")
    remove.add_argument("number", type=int, help="the job's number in `list`")
    pause = commands.add_parser("pause", parents=[common], help="pause a waiting job, or resume a paused one")
    pause.add_argument("number", type=int, help="the job's number in `list`")
    move = commands.add_parser("move", parents=[common], help="move a job to another place in the order")
    move.add_argument("number", type=int, help="the job's number in `list`")
    move.add_argument("to", type=int, help="its new number")
    return parser


def edit(queue: JobQueue, args) -> str:
    """remove / pause / move by the numbers `list` prints; IndexError or ValueError says why not."""
    index = queue.index_of(args.number)
    if args.command == "remove":
        return f"removed job {args.number}: {queue.remove(index).name}"
    if args.command == "pause":
        queue.pause(index)
        return f"job {args.number} ({queue.jobs[index].name}) is {queue.jobs[index].state}"
    queue.index_of(args.to)
    queue.move(index, args.to - args.number)
    return describe(queue)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    queue = JobQueue(args.queue)
    if args.command == "add":
        problems = []
        for path in args.configs:
            try:
                job = queue.add_file(path)
            except (ConfigError, ValueError) as error:   # ValueError: a waiting job writes the same output
                problems.append(f"{path}: {error}" if isinstance(error, ValueError) else str(error))
                continue
            print(f"added job {len(queue.jobs)}: {job.name} ({job.config})")
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 2
    elif args.command == "list":
        print(describe(queue))
    elif args.command in ("remove", "pause", "move"):
        try:
            print(edit(queue, args))
        except (IndexError, ValueError) as error:
            print(f"queue {args.command}: {error}", file=sys.stderr)
            return 2
    elif args.command == "run":
        def train_one(config_path, job):
            print(f"queue: running {job.name} ({config_path})", flush=True)
            return train_config_file(config_path, job)

        try:
            ran = queue.run(train_one)
        except QueueBusy as error:
            print(f"queue run: {error}", file=sys.stderr)
            return 2
        print(describe(queue))
        failed = [job for job in ran if job.state == "failed"]
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 25 item 1: the job queue without a display: order, persistence across a restart, a failing job, the CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.ui.JobQueue import JobQueue, describe
from modules.util.config.config_io import config_to_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "training_presets" / "#demo tiny CPU.json"


def job_config(tmp_path: Path, tiny_model, dataset, name: str, **values) -> dict:
    """A complete config (as run-configs/ holds) for a 2-step run on the tiny model."""
    overrides = {"demo_assets": "false", "model.base_model_name": str(tiny_model("wan2.1-t2v")),
                 "data.concepts": json.dumps([{"path": str(dataset)}]), "workspace_dir": str(tmp_path / name),
                 "cache_dir": str(tmp_path / "cache"),
                 "output.destination": str(tmp_path / "out" / f"{name}.safetensors"), "max_steps": "2",
                 "tensorboard": "false", "sampling.samples_file": "", "backup.every_n_steps": "0", **values}
    return config_to_dict(load_config(str(DEMO), overrides=[f"{k}={v}" for k, v in overrides.items()]))


def test_order_edits_and_persistence_across_a_restart(tmp_path):
    queue = JobQueue(tmp_path / "q" / "queue.json")
    for name in ("a", "b", "c"):
        queue.add({"epochs": 1, "output": {"destination": f"/x/{name}.safetensors"}})
    assert [job.name for job in queue.jobs] == ["a.safetensors", "b.safetensors", "c.safetensors"]
    queue.move(2, -1)                      # c before b
    queue.pause(0)                         # a is skipped until resumed
    queue.jobs[1].state = "running"        # the app dies while c runs
    queue.save()
    removed = queue.remove(2)
    assert not Path(removed.config).exists()
    restarted = JobQueue(tmp_path / "q" / "queue.json")
    assert [(job.name, job.state) for job in restarted.jobs] == [("a.safetensors", "paused"),
                                                                 ("c.safetensors", "interrupted")]
    assert restarted.next_job().name == "c.safetensors"   # an interrupted job runs again; a paused one waits
    restarted.pause(0)
    assert restarted.jobs[0].state == "waiting"
    with pytest.raises(IndexError, match="no job 5: the queue has 2"):
        restarted.index_of(5)


def test_a_job_is_a_snapshot_of_the_config(tmp_path):
    queue = JobQueue(tmp_path / "queue.json")
    config = {"epochs": 3}
    job = queue.add(config)
    config["epochs"] = 7
    assert json.loads(Path(job.config).read_text())["epochs"] == 3


def test_a_job_writing_the_output_of_a_job_still_to_run_is_refused(tmp_path):
    """Tried in the window: "Add to queue" twice with max_steps changed in between gave two jobs named
    demo_lora.safetensors writing one file; the second replaced the first's LoRA and the queue said both done."""
    queue = JobQueue(tmp_path / "queue.json")
    queue.add({"max_steps": 30, "output": {"destination": str(tmp_path / "lora.safetensors")}})
    with pytest.raises(ValueError, match=r"job 1 \(lora.safetensors, waiting\) already writes .*another output"):
        queue.add({"max_steps": 40, "output": {"destination": str(tmp_path / "." / "lora.safetensors")}})
    assert len(JobQueue(queue.path).jobs) == 1
    queue.add({"max_steps": 40, "output": {"destination": str(tmp_path / "lora-40.safetensors")}})
    queue.jobs[0].state = "done"   # a job that has run: writing its file again is a new run's business
    queue.save()
    queue.add({"max_steps": 50, "output": {"destination": str(tmp_path / "lora.safetensors")}})
    assert [job.name for job in JobQueue(queue.path).jobs] == ["lora.safetensors", "lora-40.safetensors",
                                                              "lora.safetensors"]


def test_jobs_run_in_order_a_failed_one_is_marked_and_the_queue_goes_on(tmp_path):
    queue = JobQueue(tmp_path / "queue.json")
    for name in ("one", "broken", "three"):
        queue.add({"name": name}, name=name)
    order = []

    def train_one(config_path, job):
        name = json.loads(Path(config_path).read_text())["name"]
        order.append(name)
        if name == "broken":
            raise RuntimeError("the data gives no batch in an epoch")
        return [f"/out/{name}.safetensors"], False

    ran = queue.run(train_one)
    assert order == ["one", "broken", "three"] and len(ran) == 3
    states = [(job.state, job.error, job.outputs) for job in JobQueue(tmp_path / "queue.json").jobs]
    assert states == [("done", "", ["/out/one.safetensors"]),
                      ("failed", "the data gives no batch in an epoch", []),
                      ("done", "", ["/out/three.safetensors"])]
    assert "failed: the data gives no batch" not in describe(queue) and \
        "[failed] broken" in describe(queue) and ": the data gives no batch in an epoch" in describe(queue)


def test_cli_add_list_run_remove_trains_two_jobs(tmp_path, tiny_model, squares_dataset):
    configs = []
    for name in ("first", "second"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(job_config(tmp_path, tiny_model, squares_dataset, name)))
        configs.append(path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"optimizer": {"learning_rate": -1}}))
    queue_file = tmp_path / "q.json"

    def cli(*args):
        return subprocess.run([str(ROOT / "run-cmd.sh"), "queue", *args, "--queue", str(queue_file)],
                              capture_output=True, text=True, timeout=600)

    assert cli("add", *map(str, configs)).returncode == 0
    refused = cli("add", str(bad))
    assert refused.returncode == 2 and "optimizer.learning_rate" in refused.stderr and str(bad) in refused.stderr
    listed = cli("list")
    assert "1. [waiting] first" in listed.stdout and "2. [waiting] second" in listed.stdout
    result = cli("run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "first.safetensors").is_file() and (tmp_path / "out" / "second.safetensors").is_file()
    assert "1. [done 2/0]" not in result.stdout and "[done] first" in result.stdout
    assert cli("remove", "3").returncode == 2
    assert cli("move", "2", "1").returncode == 0 and cli("pause", "1").returncode == 2   # done: not pausable
    assert [job.name for job in JobQueue(queue_file).jobs] == ["second", "first"]
    assert cli("move", "1", "5").returncode == 2
    assert cli("move", "2", "1").returncode == 0
    assert cli("remove", "1").returncode == 0
    assert [job.name for job in JobQueue(queue_file).jobs] == ["second"]


def test_cli_pause_and_move_edit_the_waiting_jobs(tmp_path, tiny_model, squares_dataset):
    sys.path.insert(0, str(ROOT / "scripts"))
    import job_queue

    queue_file = tmp_path / "q.json"
    for name in ("a", "b"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(job_config(tmp_path, tiny_model, squares_dataset, name)))
        assert job_queue.main(["add", str(path), "--queue", str(queue_file)]) == 0
    assert job_queue.main(["pause", "1", "--queue", str(queue_file)]) == 0
    assert job_queue.main(["move", "1", "2", "--queue", str(queue_file)]) == 0
    assert [(job.name, job.state) for job in JobQueue(queue_file).jobs] == [("b", "waiting"), ("a", "paused")]
    assert JobQueue(queue_file).next_job().name == "b"   # `run` skips the paused one
    assert job_queue.main(["pause", "2", "--queue", str(queue_file)]) == 0
    assert JobQueue(queue_file).jobs[1].state == "waiting"
    assert job_queue.main(["pause", "3", "--queue", str(queue_file)]) == 2


def test_a_job_running_in_a_live_process_is_not_taken_by_another(tmp_path):
    import os
    import socket

    queue = JobQueue(tmp_path / "queue.json")
    for name in ("a", "b"):
        queue.add({"epochs": 1, "output": {"destination": f"/x/{name}.safetensors"}})
    claimed = queue._claim_next()     # as `queue run` does, in this (live) process
    assert claimed.name == "a.safetensors" and claimed.runner == f"{socket.gethostname()}:{os.getpid()}"
    other = JobQueue(tmp_path / "queue.json")   # the window reading the same file meanwhile
    assert [job.state for job in other.jobs] == ["running", "waiting"]
    assert other._claim_next().name == "b.safetensors"   # the next runner takes the next job, not the running one
    # a runner that died: its job is interrupted and runs again
    other.jobs[0].runner = f"{socket.gethostname()}:{2 ** 22 + 12345}"
    other.save()
    assert [job.state for job in JobQueue(tmp_path / "queue.json").jobs] == ["interrupted", "running"]


def test_an_edit_from_an_older_view_keeps_the_changes_made_meanwhile(tmp_path):
    window = JobQueue(tmp_path / "queue.json")
    for name in ("a", "b", "c"):
        window.add({"epochs": 1, "output": {"destination": f"/x/{name}.safetensors"}})
    cli = JobQueue(tmp_path / "queue.json")
    cli.pause(0)                  # the CLI pauses a
    window.move(2, -2)            # the window, still showing a as waiting, moves c to the top
    assert [(job.name, job.state) for job in JobQueue(tmp_path / "queue.json").jobs] == [
        ("c.safetensors", "waiting"), ("a.safetensors", "paused"), ("b.safetensors", "waiting")]


def test_a_jobs_files_are_checked_when_added_and_when_run_and_a_failure_is_shown_whole(tmp_path, tiny_model,
                                                                                       squares_dataset, capsys):
    import shutil
    sys.path.insert(0, str(ROOT / "scripts"))
    import job_queue

    from modules.ui.JobQueue import train_config_file

    queue_file = tmp_path / "q.json"
    missing = tmp_path / "missing"
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps(job_config(tmp_path, tiny_model, squares_dataset, "refused")
                                  | {"data": {"concepts": [{"path": str(missing)}]}}))
    assert job_queue.main(["add", str(refused), "--queue", str(queue_file)]) == 2   # as Start: before it waits
    assert f"data.concepts.0.path: {str(missing)!r} does not exist" in capsys.readouterr().err
    assert not JobQueue(queue_file).jobs
    data = tmp_path / "data"
    shutil.copytree(squares_dataset, data)
    config = tmp_path / "job.json"
    config.write_text(json.dumps(job_config(tmp_path, tiny_model, data, "job")))
    assert job_queue.main(["add", str(config), "--queue", str(queue_file)]) == 0
    shutil.rmtree(data)                    # gone before the job runs: checked again, the job fails
    ran = JobQueue(queue_file).run(train_config_file)
    assert [job.state for job in ran] == ["failed"]
    message = f"data.concepts.0.path: {str(data)!r} does not exist"
    assert ran[0].error.startswith("invalid configuration") and message in ran[0].error
    assert message in describe(JobQueue(queue_file))   # `queue list`: the whole message, not its first line
    assert job_queue.main(["list", "--queue", str(queue_file)]) == 0 and message in capsys.readouterr().out


def test_a_second_runner_is_refused_and_names_the_holder(tmp_path, capsys):
    import os
    import socket
    sys.path.insert(0, str(ROOT / "scripts"))
    import job_queue

    from modules.ui.JobQueue import QueueBusy

    queue = JobQueue(tmp_path / "queue.json")
    queue.add({"epochs": 1, "output": {"destination": str(tmp_path / "a.safetensors")}})
    lock = queue.runner_lock().acquire()   # the window runs the queue
    try:
        assert job_queue.main(["run", "--queue", str(queue.path)]) == 2
        err = capsys.readouterr().err
        assert f"already being run by {socket.gethostname()}:{os.getpid()}" in err
        with pytest.raises(QueueBusy):
            queue.run(lambda *_: ([], False))
        assert [job.state for job in JobQueue(queue.path).jobs] == ["waiting"]   # nothing was taken
    finally:
        lock.release()
    assert [job.state for job in queue.run(lambda *_: (["x"], False))] == ["done"]   # free again


def test_a_multi_gpu_job_is_refused_when_added_and_when_run(tmp_path, tiny_model, squares_dataset, capsys):
    """A job trains inside the queue's process, which cannot launch ranks: refused with what to do instead, rather
    than trained silently on one GPU."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import job_queue

    from modules.ui.JobQueue import MULTI_GPU_REFUSED, check_job_config, train_config_file

    queue_file = tmp_path / "q.json"
    multi = job_config(tmp_path, tiny_model, squares_dataset, "multi") | {"multi_gpu": True}
    assert check_job_config(multi) == [MULTI_GPU_REFUSED]   # the window's "Add to queue" checks this
    assert check_job_config(multi | {"multi_gpu": False}) == []
    path = tmp_path / "multi.json"
    path.write_text(json.dumps(multi))
    assert job_queue.main(["add", str(path), "--queue", str(queue_file)]) == 2
    assert "press Start for this config" in capsys.readouterr().err and not JobQueue(queue_file).jobs
    queue = JobQueue(queue_file)
    queue.add(multi)                        # queued before the refusal, or its file edited since: refused at run
    ran = queue.run(train_config_file)
    assert [job.state for job in ran] == ["failed"] and MULTI_GPU_REFUSED in ran[0].error

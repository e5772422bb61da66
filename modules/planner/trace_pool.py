"""The cut traces of one plan side by side, one process per available core (composed_trace.py).

A trace is one Python thread dispatching fake tensors (nothing computes), so the traces of a plan are independent
single-threaded work: on 2 cores two of them run at once. The workers are forked from the planning process, which
has imported the planner already (a fresh interpreter would import torch and diffusers again, seconds each); where
the planning process runs other threads (the GUI plans in a worker thread) they come from a fork server that
imported the planner once, since forking a process with other threads running can copy a lock one of them holds.
Each worker runs torch with one thread. Every job and result is pickled (configs, architectures, shapes, the
numbers of a trace: small), and the results come back in the jobs' order, so a plan is the same with any number
of workers (tests/test_composed_plan.py).

`WAN_PLANNER_WORKERS`: the number of workers (default: the cores this process may run on; 1: every trace in this
process, as before, and so on a platform that cannot fork).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor, as_completed

# what a trace imports (diffusers' transformers, peft through the setups): workers start with it, not each on its own
_PRELOAD = ["modules.planner.step_trace", "modules.planner.composed_trace", "modules.model.transformer_classes",
            "modules.modelSetup.WanLoRASetup", "modules.modelSetup.WanFineTuneSetup",
            "modules.modelSetup.WanEmbeddingSetup"]
_kept = {"depth": 0, "pool": None, "how": None}   # the pool `kept()` holds between runs, and how it was made


@contextlib.contextmanager
def kept():
    """Every run() inside uses one pool: its workers keep FakeTensor's dispatch cache from one plan to the next,
    as one process tracing them all would (a fresh worker fills it again; with the cache off a 14B cut trace took
    2.8 times the CPU time). A fit holds it for its settings; it ends with the outermost `kept()`, so no worker
    stays after planning."""
    _kept["depth"] += 1
    try:
        yield
    finally:
        _kept["depth"] -= 1
        if _kept["depth"] == 0 and _kept["pool"] is not None:
            pool, _kept["pool"], _kept["how"] = _kept["pool"], None, None
            pool.shutdown()


def workers() -> int:
    """How many traces run at once."""
    named = os.environ.get("WAN_PLANNER_WORKERS", "").strip()
    if named:
        try:
            return max(1, int(named))
        except ValueError:
            raise ValueError(f"WAN_PLANNER_WORKERS: {named!r} is not a whole number of processes") from None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def makespan(sizes: list[int]) -> int:
    """When traces of these sizes end, in units of one block, as run() schedules them on workers(): the largest
    first, each to the worker that is free first."""
    loads = [0] * max(1, min(workers(), len(sizes)))
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return max(loads)


def _one_thread() -> None:
    import torch
    torch.set_num_threads(1)


def _context():
    """How workers start (None: no fork on this platform, e.g. Windows: every trace in this process)."""
    methods = multiprocessing.get_all_start_methods()
    if threading.active_count() == 1 and "fork" in methods:
        return multiprocessing.get_context("fork")
    if "forkserver" not in methods:
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run(work, jobs: list[tuple], done=None, sizes: list[int] | None = None) -> list:
    """[work(*job) for job in jobs], up to workers() at once in worker processes (`work`: a module-level
    function); `done(index)` in this process as each job ends, in the order they end. `sizes`: each job's work
    (the blocks it traces): the largest start first, so the workers end about together (3 traces of 2, 3 and 4
    blocks on 2 workers: 4 against 3 + 2, not 2 + 4 against 3)."""
    count = min(workers(), len(jobs))
    with kept():
        pool = _pool() if count > 1 else None
        if pool is None:
            results = []
            for index, job in enumerate(jobs):
                results.append(work(*job))
                if done is not None:
                    done(index)
            return results
        results = [None] * len(jobs)
        order = sorted(range(len(jobs)), key=lambda index: -sizes[index]) if sizes else range(len(jobs))
        futures = {pool.submit(work, *jobs[index]): index for index in order}
        try:
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                if done is not None:
                    done(index)
        except BaseException:   # a trace failed (e.g. a PlanError): the traces not started yet are not needed
            for future in futures:
                future.cancel()
            raise
    return results


def start(work, *args):
    """work(*args) in a worker of the kept pool, beside the traces that follow (`.result()` waits for it); where
    there is one worker, or no pool can be made, it runs here at once. Call it inside `kept()`."""
    if _kept["depth"] == 0:
        raise RuntimeError("trace_pool.start outside kept(): the pool would end before the work")
    pool = _pool() if workers() > 1 else None
    if pool is not None:
        return pool.submit(work, *args)
    done = Future()
    done.set_result(work(*args))
    return done


def _pool():
    """The kept pool, made when there is none (None: this platform cannot fork). Once made it is used while kept,
    whatever threads it runs itself."""
    if _kept["pool"] is not None and _kept["how"] == workers():
        return _kept["pool"]
    if _kept["pool"] is not None:
        _kept["pool"].shutdown()
        _kept["pool"] = None
    context = _context()
    if context is None:
        return None
    if context.get_start_method() == "fork":   # the workers start with the tracing code imported, once for all
        import importlib
        for name in _PRELOAD:
            importlib.import_module(name)
    _kept["pool"] = ProcessPoolExecutor(workers(), mp_context=context, initializer=_one_thread)
    _kept["how"] = workers()
    return _kept["pool"]

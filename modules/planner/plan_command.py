"""`benchmark.py plan` and `train.py --plan`: the prediction for a config, optionally fitted to a card, and the
check at train start that refuses a run predicted not to fit the device (before any weight loads)."""
from __future__ import annotations

import contextlib
import json
import logging
import sys

from modules.planner.memory_plan import PlanError, fit, predict
from modules.util.config.TrainConfig import TrainConfig

GIB = 1024 ** 3
log = logging.getLogger(__name__)


def add_plan_arguments(parser) -> None:
    parser.add_argument("--vram-gib", type=float, metavar="G",
                        help="a card of G GiB: plan: the fastest memory switches whose prediction fits; train: "
                             "refuse (exit 2) a run predicted not to fit G GiB, before anything loads")
    parser.add_argument("--ram-gib", type=float, metavar="R",
                        help="a host with R GiB of RAM: plan: with --vram-gib only the switches that fit both, "
                             "alone the host cuts that fit; train: refuse (exit 2) a run whose host RAM is predicted "
                             "above R GiB (default: the memory available at start), before anything loads")
    parser.add_argument("--plan-json", metavar="PATH", help="write the prediction (and the fit) to this JSON file")
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="plan per GPU for N GPUs (batch_size per GPU): every multi-GPU layout's peak, and the "
                             "fastest that fits --vram-gib")
    parser.add_argument("--skip-caching", action="store_true",
                        help="plan the training step only (not the VAE and text encoder passes of caching)")


def plan_and_print(config: TrainConfig, vram_gib: float | None, json_path: str | None = None, out=print,
                   caching: bool = True, gpus: int = 1, peak_detail: bool = False, ram_gib: float | None = None,
                   exact: bool = False, bars: bool = False) -> int:
    """Prints the prediction (and with `vram_gib` the settings that fit); 0 when it fits or no size was given,
    2 when nothing fits (or the config cannot be planned). `gpus` > 1: per GPU, every layout. `peak_detail`: also
    the largest storages at the peak and the host's parts per phase. `ram_gib`: the host's RAM, a second bound.
    `exact`: every plan traces the whole transformer (not composed). `bars`: a progress bar on stderr while it
    traces."""
    vram_gib = vram_gib if vram_gib is not None else (config.performance.auto_fit or None)   # 0: no size
    if gpus > 1:
        return _plan_per_gpu(config, gpus, vram_gib, json_path, out)
    from modules.planner.trace_pool import kept
    with kept():   # the prediction's trace workers trace the fit's too (trace_pool.py)
        return _plan_and_print(config, vram_gib, json_path, out, caching, peak_detail, ram_gib, exact, bars)


def _plan_and_print(config: TrainConfig, vram_gib: float | None, json_path: str | None, out, caching: bool,
                    peak_detail: bool, ram_gib: float | None, exact: bool, bars: bool) -> int:
    try:
        # the caching pass's plan runs in a trace worker beside the step's traces (they rarely keep both busy)
        from modules.planner.caching_plan import plan_caching_of
        from modules.planner.trace_pool import start
        caching_job = start(plan_caching_of, config) if caching else None
        with _progress_bar("planning", bars) as progress:
            prediction = predict(config, detail=peak_detail, exact=exact, progress=progress)
        out(prediction.report())
        from modules.planner.host_plan import plan_host
        host = plan_host(config, prediction)
        out(host.line())
        if peak_detail:
            out(prediction.peak_detail())
            out(host.detail())
        caching_plan = _print_caching(caching_job.result(), out) if caching else None
        result = host_result = None
        if vram_gib:
            out(f"\nfitting to {vram_gib:g} GiB" + (f" and {ram_gib:g} GiB of host RAM:" if ram_gib else ":"))
            fits_now = prediction.fits(vram_gib) and (not ram_gib or host.fits(ram_gib))
            if not fits_now:
                with _progress_bar("fitting", bars) as progress:
                    result = fit(config, vram_gib, log=out, known=prediction, ram_gib=ram_gib, exact=exact,
                                 progress=progress)
            if result is None:
                out(f"as configured: {prediction.summary(vram_gib)}")
            else:
                out(result.text())
                if result.settings is not None:
                    out("settings: " + " ".join(f"--config-value {k}={json.dumps(v)}"
                                                for k, v in result.settings.config_values().items()))
        elif ram_gib:
            from modules.planner.host_fit import fit_host
            out(f"\nfitting to {ram_gib:g} GiB of host RAM (the device's switches as set):")
            host_result = fit_host(config, ram_gib, prediction, keep_switches=True)
            out(host_result.text())
            if host_result.values:
                out("settings: " + " ".join(f"--config-value {k}={json.dumps(v)}"
                                            for k, v in host_result.values.items()))
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    if json_path:
        from modules.benchmark.common import write_json
        data = {"prediction": prediction.as_dict(), "vram_gib": vram_gib, "host": host.as_dict(), "ram_gib": ram_gib}
        if caching_plan is not None:
            data["caching"] = {"vae_gib": caching_plan.vae_bytes / GIB, "vae_tiling": caching_plan.vae_tiling,
                               "text_encoder_gib": caching_plan.text_encoder_bytes / GIB}
        if result is not None:
            data["fit"] = {"settings": result.settings.config_values() if result.settings else None,
                           "predicted_gib": result.prediction.peak_gib if result.prediction else None,
                           "tried": [[s.config_values(), gib] for s, gib in result.tried]}
        write_json(json_path, data)
    if vram_gib and result is not None and result.settings is None:
        return 2
    if vram_gib and result is None and not prediction.fits(vram_gib):
        return 2
    if host_result is not None and host_result.values is None:
        return 2
    return 0


@contextlib.contextmanager
def _progress_bar(what: str, shown: bool):
    """A tqdm bar on stderr fed by the planner's progress(done, total, text) calls (None when not `shown`)."""
    if not shown:
        yield None
        return
    from tqdm import tqdm
    # no monitor thread: with none the traces' workers fork from this process (trace_pool.py)
    tqdm.monitor_interval = 0
    with tqdm(desc=what, unit="trace", file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        def progress(done: int, total: int, text: str) -> None:
            bar.total, bar.n = total, done
            bar.set_postfix_str(text, refresh=False)
            bar.refresh()
        yield progress


def _plan_per_gpu(config: TrainConfig, gpus: int, vram_gib: float | None, json_path: str | None, out) -> int:
    from modules.planner.parallel_plan import choose, plan_layouts, report
    try:
        prediction = predict(config)
        plans = plan_layouts(config, gpus, prediction)
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    out(prediction.report().replace("predicted peak:", "one process with the whole run:", 1))
    chosen = choose(plans, vram_gib)
    out("\n" + report(plans, chosen, vram_gib))
    if chosen.config_values():
        out("settings: " + " ".join(f"--config-value {k}={json.dumps(v)}" for k, v in chosen.config_values().items()))
    if json_path:
        from modules.benchmark.common import write_json
        write_json(json_path, {"prediction": prediction.as_dict(), "vram_gib": vram_gib, "gpus": gpus,
                               "layouts": [{"layout": p.layout, "peak_gib": p.peak_gib, "host_gib": p.host_bytes / GIB,
                                            "built": p.built, "problem": p.problem} for p in plans],
                               "chosen": chosen.layout})
    return 2 if vram_gib and not chosen.fits(vram_gib) else 0


class RunDoesNotFit(PlanError):
    """The run is predicted not to fit: train refuses it (exit 2)."""


def _print_caching(plan, out):
    from modules.planner.Prediction import allowance_bytes
    out(f"caching (one encoder on the device at a time; allowance included): VAE encode "
        f"{(plan.vae_bytes + allowance_bytes(plan.vae_bytes)) / GIB:.1f} GiB (tiling "
        f"{'on' if plan.vae_tiling else 'off'}), text encoder "
        f"{(plan.text_encoder_bytes + allowance_bytes(plan.text_encoder_bytes)) / GIB:.1f} GiB")
    return plan


def check_fits_device(config: TrainConfig, device, vram_gib: float | None = None, out=print,
                      ram_gib: float | None = None) -> None:
    """At train start, before any weight loads: applies performance.auto_fit, prints the prediction, and raises
    RunDoesNotFit (naming what fits) when the run is predicted not to fit `vram_gib` (default: the CUDA device's free
    memory). A CPU device with no `vram_gib` has no card to refuse on: nothing is checked there. Then the host:
    RunDoesNotFit when its RAM is predicted above `ram_gib` (default: the memory available now), naming the phase,
    its parts and the host cuts that fit (check_fits_host)."""
    gpus = _processes(config)
    if gpus > 1:
        _check_fits_per_gpu(config, device, vram_gib, gpus, out)
        import os
        # a rank checks --ram-gib only: the memory available when it starts depends on how far the others loaded
        # (the launcher, before starting them, checks what is available)
        if ram_gib or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            check_fits_host(config, device, None, ram_gib, out, ranks=_local_ranks(gpus))
        return
    prediction = _check_fits_one_device(config, device, vram_gib, out)
    check_fits_host(config, device, prediction, ram_gib, out)


def _check_fits_one_device(config: TrainConfig, device, vram_gib: float | None, out):
    """check_fits_device's device half for one process; the prediction when one was made."""
    import torch
    if config.performance.auto_fit:
        result = fit(config, config.performance.auto_fit)
        if result.settings is None:
            raise RunDoesNotFit(f"performance.auto_fit {config.performance.auto_fit:g}: {result.text()}")
        for key, value in result.settings.config_values().items():
            section, _, name = key.rpartition(".")
            setattr(config.performance if section else config, name, value)
        out(f"memory plan (performance.auto_fit): {result.text()}")
    if vram_gib:
        free, where = vram_gib * GIB, f"--vram-gib {vram_gib:g}"
    elif torch.device(device).type == "cuda":
        free, where = torch.cuda.mem_get_info(torch.device(device))[0], f"free on {device}"
    else:
        return None
    prediction = _or_unplanned(lambda: predict(config), out)
    if prediction is None:
        return None
    out(f"memory plan: {prediction.summary(free / GIB)} ({free / GIB:.1f} GiB {where})")
    if prediction.fits(free / GIB):
        return prediction
    result = fit(config, free / GIB, known=prediction)
    raise RunDoesNotFit(f"predicted peak {prediction.peak_gib:.1f} GiB does not fit the {free / GIB:.1f} GiB "
                    f"({where}); {result.text()}"
                    + ("; set those switches, or performance.auto_fit" if result.settings else ""))


def check_fits_host(config: TrainConfig, device, prediction=None, ram_gib: float | None = None, out=print,
                    ranks: int = 1) -> None:
    """RunDoesNotFit when the run's host RAM (host_plan.py; `ranks` processes on this machine) is predicted above
    `ram_gib` GiB, default the memory available now (psutil; this process's own included), naming the phase, its
    largest parts and the host cuts that would fit. Without `prediction` (no device plan was made: a CPU run) the
    training step's own share is left out; the load and caching phases, the usual peak, are whole."""
    import psutil
    import torch
    if ram_gib:
        budget, where = ram_gib, f"--ram-gib {ram_gib:g}"
    else:
        budget = (psutil.virtual_memory().available + psutil.Process().memory_info().rss) / GIB
        where = "available at start"
    budget /= ranks
    cuda = torch.device(device).type == "cuda"
    from modules.planner.host_plan import plan_host
    try:
        host = plan_host(config, prediction, cuda=cuda)
    except PlanError:   # not planned (said by the device's check where it applies): the run starts unplanned
        return
    except Exception as error:  # noqa: BLE001  a planner defect must not stop a run that may well fit
        log.warning("host RAM plan failed (%s: %s); the run starts unplanned", type(error).__name__, error)
        return
    if host.fits(budget):
        return
    from modules.planner.host_fit import fit_host
    fitted = fit_host(config, budget, prediction, cuda=cuda, keep_switches=True)
    per = f" per process ({ranks} on this machine)" if ranks > 1 else ""
    phase = host.peak_phase
    text = (f"predicted host RAM peak{per} {host.peak_gib:.1f} GiB in phase {phase} "
            f"({host.largest_parts(phase)}) does not fit the {budget:.1f} GiB ({where}); ")
    if fitted.values:
        text += ("fits with " + " ".join(f"--config-value {k}={json.dumps(v)}" for k, v in fitted.values.items())
                 + f" ({fitted.fitted.peak_gib:.1f} GiB predicted)")
    else:
        least = fitted.fitted
        text += (f"nothing fits: the least is {least.peak_gib:.1f} GiB in phase {least.peak_phase} with every host "
                 f"cut; free memory or train on a larger machine")
    raise RunDoesNotFit(text)


def _local_ranks(gpus: int) -> int:
    """The ranks that share this machine's RAM."""
    import os
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else gpus


def _or_unplanned(plan, out):
    """plan()'s result, or None (said) when the config cannot be planned."""
    try:
        return plan()
    except PlanError as error:
        out(f"memory plan: not planned ({error}); the run starts unplanned")
    except Exception as error:  # noqa: BLE001  a planner defect must not stop a run that may well fit
        log.warning("memory plan failed (%s: %s); the run starts unplanned", type(error).__name__, error)
    return None


def _processes(config: TrainConfig) -> int:
    """The ranks this run will have: torchrun's WORLD_SIZE, or `multi_gpu`'s process count."""
    import os

    import torch
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or not config.multi_gpu:
        return world
    return config.distributed.processes or torch.cuda.device_count()


def _check_fits_per_gpu(config: TrainConfig, device, vram_gib: float | None, gpus: int, out) -> None:
    """check_fits_device for several ranks: the per-GPU plan of every layout; `performance.auto_fit` (and
    `distributed.shard_base: auto`) takes the fastest that fits, which is written into the config."""
    import torch

    from modules.planner.parallel_plan import choose, configured, plan_layouts
    budget, where = config.performance.auto_fit, "performance.auto_fit"
    if vram_gib:
        budget, where = budget or vram_gib, f"--vram-gib {vram_gib:g}"
    elif not budget and torch.device(device).type == "cuda":
        budget, where = torch.cuda.mem_get_info(torch.device(device))[0] / GIB, f"free on {device}"
    if not budget:
        return  # no card to plan for (CPU processes)
    plans = _or_unplanned(lambda: plan_layouts(config, gpus), out)
    if plans is None:
        return
    chosen = choose(plans, budget) if config.performance.auto_fit else configured(plans, config, budget)
    for key, value in chosen.config_values().items():
        if config.training_method.value == "LORA":
            setattr(config.distributed, key.rpartition(".")[2], value)
    out(f"memory plan ({gpus} GPUs, {chosen.layout}): predicted peak per GPU: {chosen.peak_gib:.1f} GiB "
        f"({budget:.1f} GiB, {where})")
    if chosen.fits(budget):
        return
    fitting = [p.layout for p in plans if p.built and p.fits(budget)]
    raise RunDoesNotFit(f"predicted peak per GPU {chosen.peak_gib:.1f} GiB ({chosen.layout}) does not fit the "
                        f"{budget:.1f} GiB ({where}); "
                        + (f"fits: {', '.join(fitting)} (distributed.shard_base / distributed.cpu_offload, or "
                           f"performance.auto_fit)" if fitting else
                           "no multi-GPU layout fits: add GPUs, lower the resolution or frames, or turn on "
                           "gradient checkpointing and activation offload"))

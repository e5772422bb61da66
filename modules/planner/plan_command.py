"""`benchmark.py plan` and `train.py --plan`: the prediction for a config, optionally fitted to a card, and the
check at train start that refuses a run predicted not to fit the device (before any weight loads)."""
from __future__ import annotations

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
    parser.add_argument("--plan-json", metavar="PATH", help="write the prediction (and the fit) to this JSON file")
    parser.add_argument("--skip-caching", action="store_true",
                        help="plan the training step only (not the VAE and text encoder passes of caching)")


def plan_and_print(config: TrainConfig, vram_gib: float | None, json_path: str | None = None, out=print,
                   caching: bool = True, peak_detail: bool = False) -> int:
    """Prints the prediction (and with `vram_gib` the settings that fit); 0 when it fits or no size was given,
    2 when nothing fits (or the config cannot be planned). `peak_detail`: also the largest storages at the peak."""
    vram_gib = vram_gib if vram_gib is not None else config.performance.auto_fit
    try:
        prediction = predict(config, detail=peak_detail)
        out(prediction.report())
        if peak_detail:
            out(prediction.peak_detail())
        caching_plan = _print_caching(config, out) if caching else None
        result = None
        if vram_gib:
            out(f"\nfitting to {vram_gib:g} GiB:")
            result = fit(config, vram_gib, log=out, known=prediction) if not prediction.fits(vram_gib) else None
            if result is None:
                out(f"as configured: {prediction.summary(vram_gib)}")
            else:
                out(result.text())
                if result.settings is not None:
                    out("settings: " + " ".join(f"--config-value {k}={json.dumps(v)}"
                                                for k, v in result.settings.config_values().items()))
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    if json_path:
        from modules.benchmark.common import write_json
        data = {"prediction": prediction.as_dict(), "vram_gib": vram_gib}
        if caching_plan is not None:
            data["caching"] = {"vae_gib": caching_plan.vae_bytes / GIB, "vae_tiling": caching_plan.vae_tiling,
                               "text_encoder_gib": caching_plan.text_encoder_bytes / GIB}
        if result is not None:
            data["fit"] = {"settings": result.settings.config_values() if result.settings else None,
                           "predicted_gib": result.prediction.peak_gib if result.prediction else None,
                           "tried": [[s.config_values(), gib] for s, gib in result.tried]}
        write_json(json_path, data)
    if vram_gib and not prediction.fits(vram_gib) and (result is None or result.settings is None):
        return 2
    return 0


class RunDoesNotFit(PlanError):
    """The run is predicted not to fit: train refuses it (exit 2)."""


def _print_caching(config: TrainConfig, out):
    from modules.planner.caching_plan import plan_caching
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    from modules.planner.Prediction import allowance_bytes
    arch = resolve_architecture(config)
    plan = plan_caching(config, arch, largest_shape(config, arch))
    out(f"caching (one encoder on the device at a time; allowance included): VAE encode "
        f"{(plan.vae_bytes + allowance_bytes(plan.vae_bytes)) / GIB:.1f} GiB (tiling "
        f"{'on' if plan.vae_tiling else 'off'}), text encoder "
        f"{(plan.text_encoder_bytes + allowance_bytes(plan.text_encoder_bytes)) / GIB:.1f} GiB")
    return plan


def check_fits_device(config: TrainConfig, device, vram_gib: float | None = None, out=print) -> None:
    """At train start, before any weight loads: applies performance.auto_fit, prints the prediction, and raises
    RunDoesNotFit (naming what fits) when the run is predicted not to fit `vram_gib` (default: the CUDA device's free
    memory). A CPU device with no `vram_gib` has no card to refuse on: nothing is checked there."""
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
        return
    try:
        prediction = predict(config)
    except PlanError as error:
        out(f"memory plan: not planned ({error}); the run starts unplanned")
        return
    except Exception as error:  # noqa: BLE001  a planner defect must not stop a run that may well fit
        log.warning("memory plan failed (%s: %s); the run starts unplanned", type(error).__name__, error)
        return
    out(f"memory plan: {prediction.summary(free / GIB)} ({free / GIB:.1f} GiB {where})")
    if prediction.fits(free / GIB):
        return
    result = fit(config, free / GIB, known=prediction)
    raise RunDoesNotFit(f"predicted peak {prediction.peak_gib:.1f} GiB does not fit the {free / GIB:.1f} GiB "
                    f"({where}); {result.text()}"
                    + ("; set those switches, or performance.auto_fit" if result.settings else ""))

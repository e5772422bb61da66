"""`benchmark.py plan --presets`: every shipped preset planned at its largest bucket, as the markdown table of
docs/benchmarks.md ("predicted on CPU", never measured), with each preset's host RAM peak (host_plan.py) on a CUDA
machine."""
from __future__ import annotations

import re

from modules.planner.memory_plan import PlanError, predict

GIB = 1024 ** 3


def preset_rows(log=lambda _text: None, only: str | None = None) -> list[dict]:
    """`only`: the presets with it in their name."""
    from modules.util.config.config_io import load_config
    from modules.util.presets import PRESET_DIR
    rows = []
    for path in sorted(PRESET_DIR.glob("*.json")):
        name = path.stem.lstrip("#")
        if only is not None and only not in name:
            continue
        size = re.search(r"(\d+)\s*GB", name)
        row = {"preset": name, "card_gb": int(size.group(1)) if size else None}
        try:
            config = load_config(preset_path=str(path))
            prediction = predict(config)
        except PlanError as error:
            row["status"] = f"not planned: {error}"
            rows.append(row)
            log(f"{name}: {row['status']}")
            continue
        from modules.planner.host_plan import plan_host
        host = plan_host(config, prediction)
        row.update(host_ram_gib=host.peak_gib, host_ram_phase=host.peak_phase,
                   trainable_parameters=prediction.trainable_parameters)
        row.update(status="predicted on CPU", shape=prediction.shape, switches=prediction.features,
                   predicted_gib=prediction.peak_gib, parts_gib={k: v / GIB for k, v in prediction.parts.items()},
                   host_gib=prediction.host_pinned_bytes / GIB, phase=prediction.peak_phase,
                   fits=None if size is None else prediction.peak_bytes <= int(size.group(1)) * 1e9)
        log(f"{name}: {prediction.summary()}")
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| preset | shape (largest bucket) | memory switches | predicted peak GiB | weights / trainable+opt / "
             "activations / transient GiB | host pinned GiB | host RAM peak GiB (phase) | card in the name |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "predicted_gib" not in row:
            lines.append(f"| {row['preset']} | - | - | {row['status']} | - | - | - | - |")
            continue
        host = f"{row['host_ram_gib']:.1f} ({row['host_ram_phase']})" if "host_ram_gib" in row else "-"
        parts = row["parts_gib"]
        card = "-" if row["card_gb"] is None else (f"{row['card_gb']} GB: " + ("fits" if row["fits"] else
                                                                              "**does not fit**"))
        lines.append(f"| {row['preset']} | {row['shape']} | {row['switches']} | {row['predicted_gib']:.1f} | "
                     f"{parts['weights']:.1f} / {parts['trainable + grads + optimizer']:.1f} / "
                     f"{parts['activations']:.1f} / {parts['transient']:.1f} | {row['host_gib']:.1f} | {host} | {card} |")
    return "\n".join(lines)

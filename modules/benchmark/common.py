"""Shared pieces of the benchmarks: tables, JSON output, memory readings, the device's peak FLOP rate."""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

GIB = 1024 ** 3

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, by a substring of torch.cuda.get_device_name().
GPU_BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain text table, columns padded to their widest cell."""
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def si(value: float, unit: str) -> str:
    """1.23e12, "FLOP" -> "1.23 TFLOP"."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def write_json(path: str | os.PathLike, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def environment() -> dict:
    """What the numbers were measured on."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": _cpu_name(),
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------------------------ memory

def rss_bytes() -> int:
    """The process's resident set size now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_in_fresh_process(module: str, call: str, what: str) -> dict:
    """`module.call` in a new interpreter (its own peak RSS, no memory left over from this one); the call prints
    nothing and returns a JSON-able dict, which is returned here."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    code = f"import json; from pathlib import Path; import {module} as m; print(json.dumps(m.{call}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def available_memory_bytes(device: torch.device) -> int:
    """Memory the run can still use: free GPU memory on CUDA, MemAvailable (plus what this process holds) on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 + rss_bytes()
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ------------------------------------------------------------------------------------------------ peak rate

def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 10,
                          budget_seconds: float = 2.0) -> float:
    """The best rate of a square matmul in `dtype` on `device`, in TFLOP/s: the CPU's "peak". A short probe: the
    size grows from 256 up to `size` until one product takes long enough to time (20 ms), within `budget_seconds`,
    so a slow path (bf16 on a CPU without bf16 units) costs seconds, not minutes."""
    deadline = time.perf_counter() + budget_seconds
    best_rate, n = 0.0, min(256, size)
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm-up (thread pool, kernels)
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            a @ b
            synchronize(device)
            best = min(best, time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
        best_rate = max(best_rate, 2 * n ** 3 / best / 1e12)
        if n >= size or best >= 0.02 or time.perf_counter() > deadline:
            return best_rate
        n = min(2 * n, size)


def default_peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak TFLOP/s, where it comes from): the datasheet bf16 peak of known GPUs, else a measured matmul rate."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_BF16_PEAK_TFLOPS.items():
            if key in name:
                return peak, f"{name} dense bf16 datasheet peak"
    rate = measure_matmul_tflops(device, dtype)
    name = str(dtype).removeprefix("torch.")
    return rate, f"measured: best square {name} matmul (a probe up to 2048) on {device.type}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None

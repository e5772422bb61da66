"""The remote's GPUs as its own tools report them: nvidia-smi's CSV, else rocm-smi's JSON, read there over SSH.

rocm-smi, as it is found on machines: it may print warnings on stdout before its JSON ("WARNING: AMD GPU device(s)
is/are in a low-power state ..."), names the product "Card Series" (ROCm 5.x and later; "Card series" before, and on
some cards only a PCI id such as "0x738c"), may put a "system" entry beside the cards, and writes "N/A" where it
cannot read a value. Memory comes as strings of bytes: "VRAM Total Memory (B)", "VRAM Total Used Memory (B)"."""
from __future__ import annotations

import json
import re

ROCM_SMI = "rocm-smi --showproductname --showmeminfo vram --json"
NVIDIA_SMI = "nvidia-smi --query-gpu=name,memory.free,memory.total --format=csv,noheader,nounits"
_PCI_ID = re.compile(r"0x[0-9a-fA-F]+")


def query_gpus(connection) -> list[tuple[str, float, float]]:
    """(name, free GiB, total GiB) of each remote GPU: nvidia-smi, else rocm-smi; empty: none."""
    status, out, _ = connection.run(NVIDIA_SMI, check=False)
    if status == 0:
        gpus = parse_nvidia_smi(out)
        if gpus:
            return gpus
    status, out, _ = connection.run(ROCM_SMI, check=False)
    return parse_rocm_smi(out) if status == 0 else []


def parse_nvidia_smi(text: str) -> list[tuple[str, float, float]]:
    """`name, free MiB, total MiB` lines; a line whose memory is not a number ("[N/A]") is left out."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [part.strip() for part in line.rsplit(",", 2)]
        free, total = (_number(part) for part in parts[1:]) if len(parts) == 3 else (None, None)
        if free is not None and total:
            gpus.append((parts[0], free / 1024, total / 1024))
    return gpus


def parse_rocm_smi(text: str) -> list[tuple[str, float, float]]:
    """The cards of `rocm-smi --showproductname --showmeminfo vram --json`, in its order; a card without a VRAM
    total is left out, as is anything that is not a card."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return []
    try:
        data = json.loads(text[start:end + 1])
    except ValueError:
        return []
    gpus = []
    for key, info in data.items() if isinstance(data, dict) else ():
        if not key.startswith("card") or not isinstance(info, dict):
            continue
        fields = {str(name).strip().lower(): value for name, value in info.items()}
        total = _number(fields.get("vram total memory (b)"))
        if not total:
            continue
        used = _number(fields.get("vram total used memory (b)")) or 0.0
        gpus.append((_rocm_name(fields, key), (total - used) / 2**30, total / 2**30))
    return gpus


def _rocm_name(fields: dict, card: str) -> str:
    """The product's name; a bare PCI id only when nothing better is said."""
    names = [str(fields[key]).strip() for key in ("card series", "device name", "card model") if key in fields]
    names = [name for name in names if name and name.upper() != "N/A"]
    readable = [name for name in names if not _PCI_ID.fullmatch(name)]
    return (readable or names or [card])[0]


def _number(value) -> float | None:
    try:
        return float(str(value).strip())
    except ValueError:
        return None

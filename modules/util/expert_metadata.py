"""Wan 2.2 A14B files say which expert they are for: a LoRA or single-file transformer written for the high-noise
expert records `wan_expert: high` (the low-noise one `low`, one meant for both `both`) and the boundary (the sigma
fraction where the experts hand over) in its safetensors header. A file loaded into the other expert (renamed from
`_high_noise` to `_low_noise`, or given as the other part) is refused naming the header; a `both` file loaded into
one expert is noted."""
from pathlib import Path

EXPERT_METADATA = "wan_expert"
BOUNDARY_METADATA = "wan_boundary_ratio"
# the model's attribute for each expert -> the name files record
EXPERT_NAMES = {"transformer": "high", "transformer_2": "low"}


def expert_metadata(part: str, boundary_ratio: float | None) -> dict[str, str]:
    """Header entries for the file of `part` ("transformer", "transformer_2" or "both")."""
    metadata = {EXPERT_METADATA: EXPERT_NAMES.get(part, part)}
    if boundary_ratio is not None:
        metadata[BOUNDARY_METADATA] = repr(float(boundary_ratio))
    return metadata


def recorded_expert(path: str | Path) -> tuple[str | None, float | None]:
    """(expert, boundary) from a file's header; (None, None) when it records none or cannot be read."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except Exception:  # noqa: BLE001 - an unreadable file records nothing; loading it says why
        return None, None
    expert = metadata.get(EXPERT_METADATA)
    try:
        boundary = float(metadata[BOUNDARY_METADATA]) if BOUNDARY_METADATA in metadata else None
    except ValueError:
        boundary = None
    return (expert if expert in ("high", "low", "both") else None), boundary


def expert_problem(path: str | Path, part: str, what: str = "it") -> str | None:
    """A sentence when the file records the other expert than `part` ("transformer" or "transformer_2")."""
    expert, _ = recorded_expert(path)
    wanted = EXPERT_NAMES[part]
    if expert in (None, "both", wanted):
        return None
    return (f"{path} records {EXPERT_METADATA}={expert!r} (the {expert}-noise expert) in its header, but {what} "
            f"would load into the {wanted}-noise expert ({part}); a renamed file? use the {expert}-noise expert's "
            f"slot, or the file written for the {wanted}-noise expert")


def expert_notes(path: str | Path, part: str, boundary_ratio: float | None) -> list[str]:
    """Notices for a file that fits: written for both experts, or for another boundary than the model's."""
    expert, boundary = recorded_expert(path)
    notes = []
    if expert == "both":
        notes.append(f"{path} records {EXPERT_METADATA}='both' (trained for both experts) and is loaded into the "
                     f"{EXPERT_NAMES[part]}-noise expert only")
    if boundary is not None and boundary_ratio is not None and abs(boundary - boundary_ratio) > 1e-6:
        notes.append(f"{path} was trained with the expert boundary {boundary:g} ({BOUNDARY_METADATA}); this model "
                     f"hands over at {boundary_ratio:g}")
    return notes

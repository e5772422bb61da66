"""What the scanned records say about the companion folders a concept names and about a control model's controls,
found before any model loads (docs/vace.md, docs/data.md).

- A concept's `control_path` or `mask_path` folder that holds nothing named as any of its clips is named (a typo
  such as `controlz` beside `controls`, or the wrong folder), while some clip found none beside it either: otherwise
  the run would train every clip without it.
- A control model (VACE, Wan-Fun Control) whose clips have no condition at all (no control, and for VACE no
  reference; `data.control.derive` none) is refused: every clip would train with a zero control. Clips
  without a control among clips with one train with a zero control, as the official code does without a video;
  the data report counts them (`control_report_line`)."""
from pathlib import Path

CONTROL_LOOKED_FOR = ("<name>_control.<video ext> or a <name>_control/ folder of frames beside each clip, a concept's "
                      "control_path folder, a manifest line's control_path")


def _from_folder(companion: str | None, folder: str) -> bool:
    return companion is not None and Path(companion).parent.resolve() == Path(folder).resolve()


def _beside(companion: str | None, clip: str, suffix: str) -> bool:
    return companion is not None and Path(companion).parent == Path(clip).parent \
        and Path(companion).stem == Path(clip).stem + suffix


def unused_folder_problems(records: list[dict], concepts, takes_control: bool) -> list[str]:
    """The concepts' `control_path` / `mask_path` folders that gave no clip its companion, where some clip of the
    concept has none beside it (`takes_control`: the model reads controls; otherwise control_path is not looked
    at here)."""
    problems = []
    for index, concept in enumerate(concepts):
        own = [r for r in records if r["concept"] is concept]
        if not concept.enabled or not own:
            continue
        folders = [("mask_path", "mask", "_mask")] + ([("control_path", "control", "_control")] if takes_control
                                                     else [])
        for field, key, suffix in folders:
            folder = getattr(concept, field)
            if not folder or any(_from_folder(r.get(key), folder) for r in own):
                continue
            if all(_beside(r.get(key), r["path"], suffix) for r in own):
                continue   # every clip has its own beside it: the folder is not needed
            examples = ", ".join(repr(Path(r["path"]).stem) for r in own[:3])
            problems.append(f"data.concepts.{index}.{field}: {folder!r} holds no {key} named as any of the "
                            f"concept's {len(own)} clips (looked for {examples}{', ...' if len(own) > 3 else ''} "
                            f"with any image or video extension, or a folder of frames): every clip would train "
                            f"without one; name the folder that holds them")
    return problems


def has_condition(record: dict, variant) -> bool:
    """The record gives the control model something to condition on (not a zero control alone). A VACE mask counts
    only with a control (without one the context holds the all-ones mask, as the official code's); Wan2.2-Fun
    Control's inpaint mask conditions on its own."""
    return bool(record.get("control")) or (variant.takes_reference_images and bool(record.get("references"))) \
        or (variant.takes_control_mask and not variant.is_vace and bool(record.get("mask")))


def blank_control_problems(records: list[dict], concepts, variant, derive: str) -> list[str]:
    """A control model none of whose clips has a control (nor, for VACE, a reference image) and no derived one."""
    if variant is None or not variant.takes_control_video or derive != "none" or not records \
            or any(has_condition(r, variant) for r in records):
        return []
    datasets = ", ".join(repr(c.path) for c in concepts if c.enabled)
    extra = " or reference images (<name>_ref.png)" if variant.is_vace else ""
    return [f"data.concepts: {variant} is a control model, but no clip of {datasets} has a control{extra}: every "
            f"clip would train with a blank (zero) control. Looked for {CONTROL_LOOKED_FOR}. Add the controls, or "
            f"set data.control.derive (canny, gray) to compute them from the clips (docs/vace.md)"]


def control_report_line(records: list[dict], variant, derive: str) -> str | None:
    """How many files train with a control of their own, and what the others get; None when all have one."""
    if variant is None or not variant.takes_control_video or not records:
        return None
    files = {r["path"]: r for r in records}
    with_control = sum(1 for r in files.values() if r.get("control"))
    if with_control == len(files):
        return None
    others = f"a derived ({derive}) control" if derive != "none" else "a zero control (docs/vace.md)"
    return f"  controls: {with_control} of {len(files)} files have their own; the others train with {others}"

"""The companions of a dataset item that a control model trains with, for the dataset viewer and the control tab:
VACE's control video, mask and reference images (modules/dataLoader/vace_scan.py), Wan2.2-Animate's pose, face,
reference, background and mask, Animate-2's driving video and reference (modules/dataLoader/animate_scan.py). Found by the data loader's own finders, so the
viewer shows what training reads. Imports no toolkit.

Every companion video is frame-aligned with its clip (the scans refuse another frame count), so one frame index
shows the same moment in each; a picture (a reference, a one-image mask) stands for every frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np



@dataclass
class Companion:
    role: str               # "control", "mask", "reference 2", "pose", ...
    path: str | None        # None: not there
    needed: bool = False    # a missing needed companion skips the item (Animate); an optional one is just absent
    derive: str = ""        # "canny" / "gray": computed from the clip (`path`) by data.control.derive, as the cache

    @property
    def missing(self) -> bool:
        return self.path is None

    @property
    def missing_text(self) -> str:
        """What a missing companion's panel says: training skips the item without a needed one and trains without
        an optional one (a VACE clip without control: a zero control)."""
        return "missing (needed)" if self.needed else "missing (none: optional)"

    @property
    def text(self) -> str:
        if self.derive:
            return f"{self.role}: derived ({self.derive}) from the clip's frames"
        if self.path is not None:
            return f"{self.role}: {Path(self.path).name}"
        return f"{self.role}: {self.missing_text}"


def kind_of(variant) -> str:
    """'vace', 'fun' (Wan-Fun Control: a control video, the clip's first frame its start image), 'animate' or ''
    (a model that takes no companions, or none known yet)."""
    if variant is None:
        return ""
    return "vace" if variant.is_vace else "fun" if variant.is_fun_control else "animate" if variant.is_animate \
        else ""


def viewer_variant(config):
    """The variant the companions are looked for by: the chosen model's (configs and headers only, no weights),
    else the config's `model.intended_variant`; None when neither says."""
    from modules.modelLoader.wan.parts.model_plan import detect_model_variant, uses_parts_loader
    from modules.util.wan_detection import NotAWanModelError
    base = Path(config.model.base_model_name or "")
    if base.is_dir() or uses_parts_loader(config.model):
        try:
            return detect_model_variant(config.model)
        except (NotAWanModelError, ValueError, OSError):
            pass
    return config.model.intended_variant


def companions_of(path: str, kind: str, record: dict | None, concept=None, mode: str = "animate",
                  derive: str = "none", variant=None) -> list[Companion]:
    """What item `path` has beside it. `record`: its scan record when it was kept (manifests name companions
    there), else the finders look beside the file. `mode`: Animate's (replace needs background and mask).
    `derive`: data.control.derive; a clip without a control file of its own shows the control derived from it.
    `variant`: which character model's companions (Animate-2's driving video and reference, else Animate's)."""
    media = Path(path)
    if kind == "fun":   # the start image is the clip's own first frame: nothing beside it
        from modules.dataLoader.vace_scan import find_control
        control = record.get("control") if record is not None else find_control(media)
        return [_control(control, path, derive)]
    if kind == "vace":
        from modules.dataLoader.mask_scan import find_mask
        from modules.dataLoader.vace_scan import find_control, find_references
        if record is not None:
            control, mask, references = record.get("control"), record.get("mask"), list(record.get("references", ()))
        else:
            control = find_control(media)
            mask = find_mask(media, concept) if concept is not None else None
            references = find_references(media)
        found = [_control(control, path, derive), Companion("mask", _text(mask))]
        found += [Companion(f"reference {i + 1}", str(r)) for i, r in enumerate(references)]
        return found + ([] if references else [Companion("reference", None)])
    if kind == "animate":
        from modules.dataLoader.animate_scan import companion_set, find_companions, needed
        companions = companion_set(variant)
        listed = (record or {}).get("companions") or {}
        beside = find_companions(media, companions=companions)
        roles = needed(mode, companions)   # every role is needed; the replace roles only in replace mode
        return [Companion(role, _text(listed.get(role) or beside.get(role)), True) for role in roles]
    return []


def _control(control, clip: str, derive: str) -> Companion:
    if control is None and derive not in ("", "none"):
        return Companion("control", clip, derive=derive)
    return Companion("control", _text(control))


def _text(path) -> str | None:
    return None if path is None else str(path)


def frame_count(path: str) -> int:
    from modules.util.video_io import probe_media
    return probe_media(path).frame_count


def frames_at(target: str, companions: list[Companion], index: int) -> dict[str, np.ndarray | str]:
    """Frame `index` of the target and of each companion (a picture: itself), by role; a companion that cannot
    be read gives its reason instead of a frame, and a missing one is left out. Slow (decodes): for a worker."""
    from modules.model.control_derive import derive_control
    from modules.util.video_io import UnreadableMediaError, probe_media, read_frames
    shown: dict[str, np.ndarray | str] = {}
    for role, path, derive in [("target", target, "")] + [(c.role, c.path, c.derive) for c in companions
                                                          if c.path is not None]:
        try:
            info = probe_media(path)
            # a picture, or a companion shorter than the clip (the scan skips such an item: shown, not hidden)
            frame = read_frames(path, [min(index, info.frame_count - 1)], info)[0]
            # the cache's own function (EncodeVACE, EncodeFunControl); it runs there on the bucket-sized clip
            shown[role] = derive_control(frame[None], derive)[0] if derive else frame
        except (UnreadableMediaError, OSError, ValueError, IndexError) as error:
            shown[role] = f"cannot be read: {getattr(error, 'reason', None) or error}"
    return shown


# the control tab's settings, by config section, shown where the config has them: (path, the model kinds it is for)
CONTROL_SECTIONS = (("data.control", ("vace", "fun")), ("animate", ("animate",)))
# while no model (nor model.intended_variant) says which kind of control, each section is titled for all its kinds
GENERAL_TITLES = {"data.control": "Control: VACE, Wan-Fun (data.control)",
                  "animate": "Character: Wan 2.2 Animate, Animate-2 (animate)"}


def control_sections(variant=None) -> list[tuple[str, str]]:
    """(section path, title) of the control settings this config schema holds, for the model's variant: the
    control section for VACE and Wan-Fun Control, the animate section for Animate, none for a model that takes no
    control. While no variant is known (None: no model chosen, none intended), every section, titled for all."""
    from modules.ui.config_fields import field_spec
    kind = kind_of(variant) if variant is not None else None
    present = []
    for path, kinds in CONTROL_SECTIONS:
        if kind is not None and kind not in kinds:
            continue
        try:
            if field_spec(path).kind == "section":   # titled by the model's own name where it is known
                present.append((path, GENERAL_TITLES[path] if variant is None else
                                f"{variant.display_name} ({path})"))
        except KeyError:
            continue
    return present

"""What the window says about a Wan variant: its name, what it takes, the files each training clip needs beside it,
the `animate.mode` values it trains and whether the config's intended variant fits the chosen model. Every word
comes from the variant's capability properties (modules/util/enum/WanVariant.py) and every file name from the data
loader's own suffixes, so the model tab, the control tab and training cannot tell different stories. Imports no
toolkit."""
from __future__ import annotations


def companion_files(variant) -> list[str]:
    """The files training reads beside a clip `<name>.mp4`, one entry per role of `variant.clip_companions`, as a
    user makes them ([] for a variant that takes none)."""
    from modules.dataLoader.animate_scan import companion_set
    from modules.dataLoader.mask_scan import MASK_SUFFIX
    from modules.dataLoader.vace_scan import CONTROL_SUFFIX, REFERENCE_SUFFIX
    if variant is None:
        return []
    character = companion_set(variant).suffixes if variant.is_animate else {}
    files = []
    for role in variant.clip_companions:
        if role == "control":
            files.append(f"<name>{CONTROL_SUFFIX}.mp4 (or a <name>{CONTROL_SUFFIX}/ folder of frames"
                         + (", or data.control.derive)" if variant.is_fun_control else ")"))
        elif role == "mask" and variant.is_vace:
            files.append(f"<name>{MASK_SUFFIX}.mp4 (optional)")
        elif role == "references":
            files.append(f"<name>{REFERENCE_SUFFIX}.png, <name>{REFERENCE_SUFFIX}2.png, ... (optional)")
        else:   # a character model's companion: its scan's own suffix; a picture for the reference
            extension = ".png" if role == "reference" else ".mp4"
            replace_only = role in ("background", "mask") and variant.takes_replacement
            files.append(f"<name>{character[role]}{extension}" + (" (replace mode)" if replace_only else ""))
    return files


def variant_name(variant) -> str:
    """The top bar's name of the chosen model: `Wan 2.2 Animate-2 14B (ANIMATE_2_14B)` (its model type is in the
    model type field beside it, which follows it: model_type_note)."""
    return f"{variant.display_name} ({variant.value})"


def model_type_note(config_type, variant) -> str:
    """Why the config's model_type was set to follow the chosen model ("" when it already fits or either is
    unknown): the model type is the chosen model's, never a choice of its own (Start refuses a mismatch)."""
    if config_type is None or variant is None or str(config_type) == variant.model_type.value:
        return ""
    return (f"model type set to {variant.model_type.value} (was {config_type}): the chosen model is "
            f"{variant.display_name}")


def conditions(variant) -> list[str]:
    """What the variant takes beyond the prompt, in words, from its capabilities."""
    if variant is None:
        return []
    return [text for text, takes in (
        ("a control video", variant.takes_control_video),
        ("a mask video (white = generate)" + ("" if variant.is_vace else ", in samples"), variant.takes_control_mask),
        ("reference images", variant.takes_reference_images),
        ("a start image (in training the clip's first frame; in samples `image`)", variant.is_fun_control),
        ("a start image (optionally an end image)", variant.takes_image_condition),
        ("a pose video", variant.takes_pose_video),
        ("a face video", variant.takes_face_video),
        ("a driving video (another performer doing the motion, attended in context)", variant.takes_driving_video),
        ("a reference image of the character", variant.takes_reference_image),
        ("in replace mode a background video and the character's mask", variant.takes_replacement)) if takes]


def variant_description(variant) -> str:
    """The model tab's line: name, what it takes and the files per clip; "" for a variant that takes nothing
    beyond the prompt (T2V) and for None."""
    taken = conditions(variant)
    if not taken:
        return ""
    files = companion_files(variant)
    experts = ", two experts (high and low noise)" if variant.has_two_experts else ""
    return f"{variant.display_name}{experts}: takes " + "; ".join(taken) + \
        (f". Per clip <name>.mp4: " + ", ".join(files) if files else "")


def animate_mode_choices(variant) -> tuple[list[str], str]:
    """The `animate.mode` menu's values for the chosen model, and a note when a mode does not apply: Animate-2 takes
    no background or mask, so replace is not offered. While no model says which, both."""
    if variant is None or not variant.is_animate:
        return ["animate", "replace"], ""
    modes = list(variant.animate_modes)
    if "replace" in modes:
        return modes, ""
    return modes, (f"replace does not apply to {variant.display_name}: it takes no background video or mask "
                   f"(Start refuses animate.mode=replace for it)")


def intended_variant_note(intended, detected) -> str:
    """Why `model.intended_variant` differs from the chosen model's variant, and what to do; "" when it fits (or
    when either is unknown)."""
    if intended is None or detected is None or intended is detected:
        return ""
    return (f"the config (preset) is made for {intended.value} ({intended.display_name}) but the chosen model is "
            f"{detected.value} ({detected.display_name}): Start refuses it, the preset's settings are meant for "
            f"{intended.value}. Load a preset made for {detected.value}, or set intended variant to "
            f"{detected.value} (or to nothing: any model)")

"""Which Linear modules of a Wan transformer a LoRA (LoHa, LoKr) adapter wraps, from `lora.targets` and
`lora.custom_targets`, on diffusers module names. Works on names alone, so the config check (validation.py) can run
it on a transformer built on the meta device, before any weight loads, and training on the loaded one."""
import re

# Animate-2's blocks name their layers as the official code: self_attn / cross_attn, ffn.0 / ffn.2
_ATTENTION = r"blocks\.\d+\.(attn[12]|self_attn|cross_attn)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj)"
_MLP = r"blocks\.\d+\.ffn\.(net\.0\.proj|net\.2|0|2)"
TARGET_PRESETS = {
    "attn-only": f"{_ATTENTION}",
    "attn-mlp": f"({_ATTENTION}|{_MLP})",
    "blocks-full": r"blocks\.\d+\..+",
    # VACE models: the VACE blocks alone (every Linear of them, their before/after projections included), as VACE's
    # authors trained them; the choices above keep meaning the base blocks (a full match never takes `vace_blocks`)
    "vace": r"vace_blocks\.\d+\..+",
}
# Wan2.2-Animate's face adapter blocks (lora.face_adapter), added to any of the choices above
FACE_ADAPTER = r"face_adapter\.\d+\.(to_q|to_k|to_v|to_out)"
# Characters that make a single custom target a regex rather than a module-name suffix.
REGEX_CHARACTERS = "\\()[]|*+?"


class LoraTargetError(ValueError):
    pass


def custom_target_regex(custom: list[str]) -> re.Pattern | None:
    """The compiled regex when `custom` is one regex; None when it lists module-name suffixes.
    Raises LoraTargetError when the regex does not compile."""
    if len(custom) != 1 or not any(c in custom[0] for c in REGEX_CHARACTERS):
        return None
    try:
        return re.compile(custom[0])
    except (re.error, OverflowError, RecursionError) as e:
        raise LoraTargetError(f"lora.custom_targets: {custom[0]!r} is not a regular expression ({e})") from None


def lora_target_names(linear_names: list[str], targets: str, custom: list[str], face_adapter: bool = False
                      ) -> list[str]:
    """The names among `linear_names` (the transformer's Linear modules) the adapter wraps. Custom targets are
    module-name suffixes, or one regex matched against the whole name. `face_adapter` adds Animate's face adapter
    blocks."""
    if targets == "custom":
        if not custom:
            raise LoraTargetError("lora.custom_targets: empty, but lora.targets is 'custom'")
        pattern = custom_target_regex(custom)
        if pattern is None:
            chosen = [n for n in linear_names if any(n == c or n.endswith("." + c) for c in custom)]
        else:
            chosen = [n for n in linear_names if pattern.fullmatch(n)]
    else:
        pattern = re.compile(TARGET_PRESETS[targets])
        chosen = [n for n in linear_names if pattern.fullmatch(n)]
    if face_adapter:
        face = [n for n in linear_names if re.fullmatch(FACE_ADAPTER, n) and n not in chosen]
        if not face and not any(re.fullmatch(FACE_ADAPTER, n) for n in chosen):
            raise LoraTargetError("lora.face_adapter: the transformer has no face adapter (Wan2.2-Animate-14B has "
                                  "one); turn it off for this model")
        chosen += face
    if not chosen:
        what = f"lora.custom_targets: {custom!r}" if targets == "custom" else f"lora.targets: {targets!r}"
        raise LoraTargetError(f"{what} matches no Linear module of the transformer; examples of names: "
                              f"{linear_names[-4:]}")
    return chosen

"""The accelerators users hold, written tiny with their publishers' real key names, read by content and applied as
ComfyUI's LoRA loader applies them (and LightX2V's, for the one key ComfyUI does not read).

The files (key names from the code that writes or reads them):
- lightx2v distill LoRAs (lightx2v/Wan2.1-Distill-Loras, Wan2.2-Distill-Loras), written by LightX2V's
  tools/extract/lora_extractor.py (github.com/ModelTC/LightX2V, commit f8aee98): `diffusion_model.<official name>`;
  a weight of a million parameters or more is decomposed to `.lora_up.weight` / `.lora_down.weight` with no `.alpha`
  (scale 1); every smaller weight (norms, `head.head`, `patch_embedding`) is stored whole as `.diff`, every bias as
  `.diff_b`, every `.modulation` parameter as `.diff_m` (`blocks.N.diff_m`, `head.diff_m`). The same names appear in
  ComfyUI's "lora key not loaded: diffusion_model.blocks.0.diff_m" log for Wan21_I2V_14B_lightx2v_cfg_step_distill_
  lora_rank64 (kijai/ComfyUI-WanVideoWrapper issue 807) and the `.diff` / `.diff_b` / `.lora_down.weight` keys of the
  same family in issue 1862. diffusers' reader notes the `head.head.diff` of Wan2.2-Distill-Loras.
- Wan2.2-Lightning (lightx2v/Wan2.2-Lightning, Seko / Moe-Distill high_noise_model and low_noise_model):
  `.lora_down.weight` / `.lora_up.weight` with an `.alpha` per module (DiffSynth-Studio issue 1067's converter
  reads `key.replace('alpha', 'lora_down.weight')`; diffusers PR 12074: "lightning lora (has `alpha` keys)").
- CausVid (Kijai's Wan21_CausVid_14B_T2V_lora_rank32): lora_down / lora_up and `.diff_b`, including
  `time_projection.1` (diffusers lora_conversion_utils: "CausVid lora has the weight keys and the bias keys").
- AccVid (Kijai's Wan21_AccVid_T2V_14B_lora_rank32): the same with a `time_projection.1.diff_b` and no low-rank pair
  for that layer (diffusers: "AccVideo lora has diff bias keys but not the weight keys").

The reference applies each file to the official-named state dict as ComfyUI's comfy/lora.py `load_lora` and
`calculate_weight` do (`W + s * up @ down * (alpha / rank, 1 without .alpha)`, `W + s * diff`, `bias + s * diff_b`),
and `.diff_m` as LightX2V's lightx2v/utils/lora_loader.py `apply_lora` does (`modulation + s * diff_m`; ComfyUI does
not read that key: its generic name for a modulation delta is `<name>.modulation.diff`, also checked here), then
loads the result into a fresh transformer. Our accelerated forward must equal its forward.
"""
import pytest
import torch
from safetensors.torch import save_file

from modules.modelSampler.accelerator import accelerated, load_accelerator
from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.lora.keys import diffusers_to_original_state_dict, original_to_diffusers_state_dict
from test_accelerator import _forward, load, one_thread  # noqa: F401 (autouse)

PREFIX = "diffusion_model."
RANK = 4


def _published(original: dict[str, torch.Tensor], kind: str, seed: int) -> dict[str, torch.Tensor]:
    """A tiny accelerator of `kind` over an official-named state dict. The extractor decomposes a weight of a million
    parameters or more: at 14B every 2D weight but `head.head` (5120 x 64); the tiny model's sizes are scaled down, so
    that rule is applied by name."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=generator) * scale
    sd = {}
    for key, value in original.items():
        stem, _, parameter = key.rpartition(".")
        in_block = key.startswith("blocks.") and (".self_attn." in key or ".cross_attn." in key or ".ffn." in key)
        low_rank = parameter == "weight" and value.dim() == 2 and stem != "head.head"
        if kind in ("lightning", "causvid", "accvid") and not (in_block or stem.startswith("time_projection")):
            continue
        if low_rank:
            if kind == "accvid" and stem.startswith("time_projection"):
                continue
            sd[f"{PREFIX}{stem}.lora_down.weight"] = rand(RANK, value.shape[1], scale=0.3)
            sd[f"{PREFIX}{stem}.lora_up.weight"] = rand(value.shape[0], RANK, scale=0.3)
            if kind == "lightning":
                sd[f"{PREFIX}{stem}.alpha"] = torch.tensor(8.0)
        elif kind == "lightning":
            continue
        elif parameter == "bias":
            sd[f"{PREFIX}{stem}.diff_b"] = rand(*value.shape)
        elif kind in ("causvid", "accvid"):
            continue
        elif parameter == "modulation":
            sd[f"{PREFIX}{stem}.diff_m"] = rand(*value.shape)
        elif parameter == "weight":
            sd[f"{PREFIX}{stem}.diff"] = rand(*value.shape, scale=0.02 if value.dim() > 1 else 0.1)
    return sd


def _comfyui_reference(original: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], strength: float
                       ) -> dict[str, torch.Tensor]:
    """The official state dict patched by the file, by ComfyUI's rules (LightX2V's for `.diff_m`)."""
    patched = {key: value.clone().float() for key, value in original.items()}
    for key, value in sd.items():
        name = key.removeprefix(PREFIX)
        if name.endswith(".lora_down.weight"):
            stem = name.removesuffix(".lora_down.weight")
            up = sd[f"{PREFIX}{stem}.lora_up.weight"]
            alpha = sd.get(f"{PREFIX}{stem}.alpha")
            scale = 1.0 if alpha is None else float(alpha) / value.shape[0]
            patched[f"{stem}.weight"] += strength * scale * (up.float() @ value.float())
        elif name.endswith(".diff_b"):
            patched[name.removesuffix(".diff_b") + ".bias"] += strength * value
        elif name.endswith(".diff_m"):
            patched[name.removesuffix(".diff_m") + ".modulation"] += strength * value
        elif name.endswith(".diff"):
            target = name.removesuffix(".diff")
            target = target if target.endswith(".modulation") else target + ".weight"
            patched[target] += strength * value
    return patched


def _check(model, expert: str, original: dict, sd: dict, strength: float, accelerator):
    transformer = getattr(model, expert)
    reference = type(transformer).from_config(transformer.config)
    reference.load_state_dict(original_to_diffusers_state_dict(_comfyui_reference(original, sd, strength)))
    reference.eval()
    plain = _forward(transformer)
    with accelerated(model, accelerator):
        fast = _forward(transformer)
    assert (fast - plain).abs().max() > 1e-2
    torch.testing.assert_close(fast, _forward(reference), atol=1e-5, rtol=1e-5)
    assert torch.equal(_forward(transformer), plain)


@pytest.mark.parametrize("kind", ["lightx2v", "causvid", "accvid"])
def test_a_published_wan21_accelerator_acts_as_comfyui_applies_it(kind, tiny_model, tmp_path):
    model = load(tiny_model("wan2.1-t2v"))
    original = diffusers_to_original_state_dict(model.transformer.state_dict())
    sd = _published(original, kind, seed=1)
    suffixes = {key.rsplit(".", 1)[-1] for key in sd}
    if kind == "lightx2v":   # every kind of key the extractor writes is in the file
        assert {"diff", "diff_b", "diff_m"} <= suffixes and f"{PREFIX}head.head.diff" in sd
        assert f"{PREFIX}head.diff_m" in sd and f"{PREFIX}blocks.0.diff_m" in sd
    if kind == "accvid":
        assert f"{PREFIX}time_projection.1.diff_b" in sd
        assert f"{PREFIX}time_projection.1.lora_down.weight" not in sd
    path = tmp_path / f"{kind}.safetensors"
    save_file(sd, str(path))
    accelerator = load_accelerator(model, AcceleratorConfig(file=str(path), strength=0.8))
    _check(model, "transformer", original, sd, 0.8, accelerator)


def test_a_modulation_delta_in_comfyuis_generic_name_acts_as_diff_m(tiny_model, tmp_path):
    model = load(tiny_model("wan2.1-t2v"))
    original = diffusers_to_original_state_dict(model.transformer.state_dict())
    generator = torch.Generator().manual_seed(5)
    sd = {f"{PREFIX}blocks.0.modulation.diff": torch.randn(original["blocks.0.modulation"].shape,
                                                            generator=generator) * 0.3,
          f"{PREFIX}head.modulation.diff": torch.randn(original["head.modulation"].shape, generator=generator) * 0.3}
    path = tmp_path / "generic.safetensors"
    save_file(sd, str(path))
    _check(model, "transformer", original, sd, 1.0,
           load_accelerator(model, AcceleratorConfig(file=str(path))))


def test_wan22_lightning_high_and_low_files_act_on_their_experts(tiny_model, tmp_path):
    model = load(tiny_model("wan2.2-t2v-a14b"))
    files, originals = {}, {}
    for seed, (expert, name) in enumerate((("transformer", "high_noise_model"),
                                           ("transformer_2", "low_noise_model"))):
        originals[expert] = diffusers_to_original_state_dict(getattr(model, expert).state_dict())
        files[expert] = _published(originals[expert], "lightning", seed=seed + 7)
        assert any(key.endswith(".alpha") for key in files[expert])
        save_file(files[expert], str(tmp_path / f"{name}.safetensors"))
    accelerator = load_accelerator(model, AcceleratorConfig(file=str(tmp_path / "high_noise_model.safetensors"),
                                                            file_2=str(tmp_path / "low_noise_model.safetensors"),
                                                            strength=1.0))
    for expert in files:
        _check(model, expert, originals[expert], files[expert], 1.0, accelerator)

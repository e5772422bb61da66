"""E2V condition tensors on the tiny Wan 2.1 I2V model (VAE z 16, temporal stride 4), and the T2V expansion.

Every expected condition is computed here from the rules of DESIGN.md section 6, straight from the VAE and the
configured latent statistics (never with the functions under test): the mini-video frame by frame, the mask as
literal per-latent-frame channel rows.
"""
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from modules.model.e2v_condition import (apply_frame_conditioning, build_mini_video, clip_tokens, condition_from_cache,
                                         condition_subsets, element_to_tensor, encode_condition_cache,
                                         make_e2v_condition, preprocess_element, reference_latent_frames,
                                         reference_loss_mask, target_video_with_references)
from modules.model.e2v_expansion import expand_t2v_for_e2v, expanded_parameter_names
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.tiny_models import CLIP_HIDDEN, CLIP_TOKENS, INNER_DIM, SPECS, TEXT_DIM, make_transformer
from modules.util.wan_detection import detect_variant

F, H, W = 13, 16, 16          # 13 pixel frames -> T = 4 latent frames of 2 x 2
T = 4
ONES, ZERO = [1, 1, 1, 1], [0, 0, 0, 0]


@pytest.fixture(scope="module")
def model(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-i2v"))))


@pytest.fixture(scope="module")
def elements():
    """Three distinct element images in [-1, 1]: smooth colour ramps, different per element."""
    ys = torch.linspace(-1, 1, H).view(H, 1).expand(H, W)
    xs = torch.linspace(-1, 1, W).view(1, W).expand(H, W)
    return [torch.stack([0.8 * xs, -0.6 * ys, 0.3 + 0 * xs]),
            torch.stack([-0.5 + 0 * xs, 0.9 * ys, xs * ys]),
            torch.stack([0.7 * ys, 0.2 + 0 * xs, -0.8 * xs])]


# --- the expected values, from the DESIGN rules --------------------------------------------------------------------

_ENCODED: dict = {}


@torch.no_grad()
def normalized_vae_latents(model, video):
    """(3, F, H, W) -> (16, T, h, w): VAE posterior mean, (z - mean) / std per channel (memoised per video)."""
    key = (id(model), video.shape, video.numpy().tobytes())
    if key not in _ENCODED:
        z = model.vae.encode(video.unsqueeze(0)).latent_dist.mode()[0]
        mean = torch.tensor(model.vae.config.latents_mean).view(-1, 1, 1, 1)
        std = torch.tensor(model.vae.config.latents_std).view(-1, 1, 1, 1)
        _ENCODED[key] = (z - mean) / std
    return _ENCODED[key].clone()


def expected_before(model, elements, repeats):
    video, start = torch.zeros(3, F, H, W), 0
    for element, repeat in zip(elements, repeats):
        if element is not None:
            for frame in range(start, start + repeat):
                video[:, frame] = element
        start += repeat
    return normalized_vae_latents(model, video)


def expected_after(model, elements):
    grey = normalized_vae_latents(model, torch.zeros(3, 1, H, W))
    latents = grey.repeat(1, T, 1, 1)
    for slot, element in enumerate(elements):
        if element is not None:
            latents[:, slot] = normalized_vae_latents(model, element.unsqueeze(1))[:, 0]
    return latents


def expected_mask(rows):
    """rows[t] = the 4 mask channels of latent frame t -> (4, T, h, w)."""
    rows = list(rows) + [ZERO] * (T - len(rows))
    return torch.tensor(rows, dtype=torch.float32).t()[:, :, None, None].expand(4, T, H // 8, W // 8)


def pick(elements, present):
    return [element if keep else None for element, keep in zip(elements, present)]


# --- golden conditions ---------------------------------------------------------------------------------------------

# (combine, repeats, present slots, expected mask rows per latent frame)
CASES = {
    "before-1-element": ("before", [1], [1], [ONES]),
    "before-1-element-repeat-4": ("before", [4], [1], [ONES, [1, 1, 1, 0]]),
    "before-2-aligned": ("before", [1, 4], [1, 1], [ONES, ONES]),
    "before-3-aligned": ("before", [1, 4, 4], [1, 1, 1], [ONES, ONES, ONES]),
    # pixel frames 0..11 of 13: m[0] x4 | m1..4 | m5..8 | m9..12 = 1,1,1,0
    "before-3-unaligned": ("before", [4, 4, 4], [1, 1, 1], [ONES, ONES, ONES, [1, 1, 1, 0]]),
    "before-missing-middle-aligned": ("before", [1, 4, 4], [1, 0, 1], [ONES, ZERO, ONES]),
    # pixel frames 0..3 and 8..11 of 13: 1111 | 1,1,1,0 | 0,0,0,1 | 1,1,1,0
    "before-missing-middle-unaligned": ("before", [4, 4, 4], [1, 0, 1],
                                        [ONES, [1, 1, 1, 0], [0, 0, 0, 1], [1, 1, 1, 0]]),
    "after-1-element": ("after", [1], [1], [ONES]),
    "after-2-elements": ("after", [1, 4], [1, 1], [ONES, ONES]),
    "after-3-unaligned": ("after", [4, 4, 4], [1, 1, 1], [ONES, ONES, ONES]),
    "after-missing-middle": ("after", [1, 4, 4], [1, 0, 1], [ONES, ZERO, ONES]),
}


@pytest.mark.parametrize("case", CASES)
def test_golden_condition(model, elements, case):
    combine, repeats, present, rows = CASES[case]
    chosen = pick(elements[:len(present)], present)
    with torch.no_grad():
        condition = make_e2v_condition(model, chosen, repeats, F, combine, concatenate_mask=True)
        no_mask = make_e2v_condition(model, chosen, repeats, F, combine, concatenate_mask=False)
    expected = expected_before(model, chosen, repeats) if combine == "before" else expected_after(model, chosen)
    assert condition.shape == (20, T, H // 8, W // 8)
    assert torch.equal(condition[:4], expected_mask(rows))
    torch.testing.assert_close(condition[4:], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(no_mask, condition[4:])


def test_batched_elements_give_a_batched_condition(model, elements):
    batch = [torch.stack([element, -element]) for element in elements]
    with torch.no_grad():
        condition = make_e2v_condition(model, [batch[0], None, batch[2]], [1, 4, 4], F, "before")
        second = make_e2v_condition(model, [-elements[0], None, -elements[2]], [1, 4, 4], F, "before")
    assert condition.shape == (2, 20, T, H // 8, W // 8)
    torch.testing.assert_close(condition[1], second, atol=1e-5, rtol=1e-5)


def test_mini_video_slots_never_shift(elements):
    video, mask = build_mini_video([elements[0], None, elements[2]], [1, 4, 4], F)
    assert video.shape == (3, F, H, W)
    assert torch.equal(mask, torch.tensor([1.] + [0.] * 4 + [1.] * 4 + [0.] * 4))
    assert torch.equal(video[:, 0], elements[0])
    assert not video[:, 1:5].any() and not video[:, 9:].any()
    assert all(torch.equal(video[:, f], elements[2]) for f in range(5, 9))
    with pytest.raises(ValueError, match="do not fit"):
        build_mini_video(elements, [4, 4, 4], 9)


# --- frame conditioning ------------------------------------------------------------------------------------------

def test_frame_conditioning_modes():
    every, middle_missing = [True, True, True], [True, False, True]
    assert apply_frame_conditioning(every, "full") == every
    assert apply_frame_conditioning(middle_missing, "full") == middle_missing
    assert apply_frame_conditioning(every, "index", 1) == [False, True, False]
    assert apply_frame_conditioning(middle_missing, "index", 1) == [False, False, False]
    assert apply_frame_conditioning(every, "prefix", 1) == [True, True, False]
    assert apply_frame_conditioning(middle_missing, "prefix", 1) == [True, False, False]
    assert apply_frame_conditioning(every, "first_and_last") == [True, False, True]
    assert apply_frame_conditioning([False, True, True], "first_and_last") == [False, True, True]
    assert apply_frame_conditioning([False, True, False], "first_and_last") == [False, True, False]
    with pytest.raises(ValueError, match="unknown frame_conditioning"):
        apply_frame_conditioning(every, "last")


def test_random_frame_conditioning_draws_every_non_empty_subset_of_the_present_slots():
    generator = torch.Generator().manual_seed(3)
    draws = {tuple(apply_frame_conditioning([True, True, True], "random", 0, generator)) for _ in range(200)}
    assert draws == set(condition_subsets([True, True, True], "random")) and len(draws) == 7
    assert (False, False, False) not in draws
    draws = {tuple(apply_frame_conditioning([True, False, True], "random", 0, generator)) for _ in range(100)}
    assert draws == {(True, False, False), (False, False, True), (True, False, True)}
    replay = [apply_frame_conditioning([True] * 3, "random", 0, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert replay[0] == replay[1]


@pytest.mark.parametrize("combine", ["before", "after"])
@pytest.mark.parametrize("mode", ["full", "index", "prefix", "random", "first_and_last"])
def test_condition_from_cache_is_exact_and_needs_no_vae(model, elements, combine, mode, monkeypatch):
    repeats, present = [1, 4, 4], [True, True, True]
    with torch.no_grad():
        cache = encode_condition_cache(model, elements, repeats, F, combine, mode, frame_index=1)
    subsets = condition_subsets(present, mode, 1)
    if combine == "after":
        assert sorted(cache) == ["grey", "slot.0", "slot.1", "slot.2"]
    else:
        assert len(cache) == (7 if mode == "random" else 1)

    expected = {kept: expected_before(model, pick(elements, kept), repeats) if combine == "before"
                else expected_after(model, pick(elements, kept)) for kept in subsets}

    def no_vae(*args, **kwargs):
        raise AssertionError("a training step must not call the VAE")
    monkeypatch.setattr(model.vae, "encode", no_vae)
    drawn = apply_frame_conditioning(present, mode, 1, torch.Generator().manual_seed(0))
    assert tuple(drawn) in subsets
    for kept in subsets:
        condition = condition_from_cache(model, cache, kept, repeats, F, combine, concatenate_mask=True)
        rows = [ONES if keep else ZERO for keep in kept]   # aligned repeats: slot k is latent frame k
        assert torch.equal(condition[:4], expected_mask(rows)), kept
        torch.testing.assert_close(condition[4:], expected[kept], atol=1e-4, rtol=1e-4)
        assert torch.equal(condition_from_cache(model, cache, kept, repeats, F, combine, concatenate_mask=False),
                           condition[4:])


# --- CLIP pathway --------------------------------------------------------------------------------------------------

def test_clip_tokens_in_position_order(model):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
              preprocess_element(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8), 32, 32, "pad_white"),
              np.full((32, 32, 3), 200, dtype=np.uint8)]
    with torch.no_grad():
        tokens = clip_tokens(model, images)
        alone = []
        for image in images:
            pixels = model.image_processor(images=[image], return_tensors="pt").pixel_values
            alone.append(model.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][0])
    assert tokens.shape == (3 * CLIP_TOKENS, CLIP_HIDDEN)
    for index, expected in enumerate(alone):
        torch.testing.assert_close(tokens[index * CLIP_TOKENS:(index + 1) * CLIP_TOKENS], expected,
                                   atol=1e-5, rtol=1e-5)
    assert clip_tokens(model, []).shape == (0, CLIP_HIDDEN)


# --- element preprocessing -----------------------------------------------------------------------------------------

def stripes():
    """20 x 40: four vertical stripes of 10 columns, red, green, blue, yellow."""
    image = np.zeros((20, 40, 3), dtype=np.uint8)
    for index, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]):
        image[:, index * 10:(index + 1) * 10] = colour
    return image


def test_preprocess_modes():
    red, green, blue, yellow = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)
    resized = preprocess_element(stripes(), 32, 32, "resize", "nearest")
    assert resized.shape == (32, 32, 3) and resized.dtype == np.uint8
    assert [tuple(resized[16, x]) for x in (2, 10, 18, 28)] == [red, green, blue, yellow]
    # cover: scale 1.6 -> 32 x 64, the centre 32 columns are the green and blue stripes
    cropped = preprocess_element(stripes(), 32, 32, "center_crop", "nearest")
    assert tuple(cropped[16, 4]) == green and tuple(cropped[16, 28]) == blue
    assert not (cropped == np.array(red)).all(-1).any()
    # fit: scale 0.8 -> 16 x 32 in rows 8..23, bars above and below
    padded = preprocess_element(stripes(), 32, 32, "pad_white", "nearest")
    assert (padded[:8] == 255).all() and (padded[24:] == 255).all()
    assert [tuple(padded[16, x]) for x in (2, 10, 18, 28)] == [red, green, blue, yellow]
    boxed = preprocess_element(stripes(), 32, 32, "letterbox", "area")
    assert (boxed[:8] == 0).all() and (boxed[24:] == 0).all() and tuple(boxed[16, 2]) == red
    tensor = element_to_tensor(padded)
    assert tensor.shape == (3, 32, 32) and tensor.max() == 1 and tensor.min() == -1
    with pytest.raises(ValueError, match="unknown preprocess"):
        preprocess_element(stripes(), 32, 32, "zoom")


# --- target video and loss mask ------------------------------------------------------------------------------------

def test_target_video_prepend_and_overlay(elements):
    repeats = [1, 4, 4]
    mini = torch.zeros(3, F, H, W)
    mini[:, 0] = elements[0]
    mini[:, 1:5] = elements[1][:, None]
    mini[:, 5:9] = elements[2][:, None]
    mask = torch.tensor([1.] * 9 + [0.] * (F - 9))
    clip = torch.rand(3, 20, H, W) * 2 - 1
    prepended = target_video_with_references(mini, mask, clip, sum(repeats), "prepend")
    assert prepended.shape == (3, F, H, W)
    assert torch.equal(prepended[:, :9], mini[:, :9]) and torch.equal(prepended[:, 9:], clip[:, :F - 9])
    assert torch.equal(target_video_with_references(mini, mask, clip, 9, "overlay"), clip[:, :F])
    with pytest.raises(ValueError, match="after the first"):
        target_video_with_references(mini, mask, clip, 5, "prepend")


def test_reference_loss_mask():
    assert reference_latent_frames(9) == 3 and reference_latent_frames(12) == 4 and reference_latent_frames(1) == 1
    assert reference_latent_frames(0) == 0
    assert torch.equal(reference_loss_mask(T, 3, True), torch.ones(1, 1, T, 1, 1))
    excluded = reference_loss_mask(T, 3, "exclude")
    assert excluded.shape == (1, 1, T, 1, 1) and excluded.flatten().tolist() == [0, 0, 0, 1]


# --- T2V expansion -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def t2v_transformer():
    return make_transformer(SPECS["wan2.1-t2v"], 0)


def transformer_inputs(condition_channels, image_tokens):
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 3, 8, 8, generator=generator)
    condition = torch.randn(1, condition_channels, 3, 8, 8, generator=generator)
    text = torch.randn(1, 512, TEXT_DIM, generator=generator)      # padded to 512, as the image branch needs
    image = torch.randn(1, image_tokens, CLIP_HIDDEN, generator=generator) if image_tokens else None
    return latents, condition, text, image, torch.tensor([700.0])


@pytest.mark.parametrize("condition_channels, image_dim", [(20, CLIP_HIDDEN), (16, None)])
def test_expanded_t2v_equals_the_base_model_at_step_0(t2v_transformer, condition_channels, image_dim):
    expanded = expand_t2v_for_e2v(t2v_transformer, condition_channels, image_dim)
    latents, condition, text, image, timestep = transformer_inputs(condition_channels, 2 * CLIP_TOKENS
                                                                   if image_dim else 0)
    with torch.no_grad():
        base = t2v_transformer(latents, timestep, text).sample
        output = expanded(torch.cat([latents, condition], dim=1), timestep, text,
                          encoder_hidden_states_image=image).sample
    torch.testing.assert_close(output, base, atol=1e-6, rtol=1e-6)


def test_expanded_t2v_layout(t2v_transformer):
    expanded = expand_t2v_for_e2v(t2v_transformer, 20, CLIP_HIDDEN)
    config = expanded.config
    assert (config.in_channels, config.out_channels, config.image_dim, config.added_kv_proj_dim) == \
           (36, 16, CLIP_HIDDEN, INNER_DIM)
    weight, base_weight = expanded.patch_embedding.weight, t2v_transformer.patch_embedding.weight
    assert weight.shape == (INNER_DIM, 36, 1, 2, 2)
    assert torch.equal(weight[:, :16], base_weight) and not weight[:, 16:].any()
    assert torch.equal(expanded.patch_embedding.bias, t2v_transformer.patch_embedding.bias)
    assert expanded.condition_embedder.image_embedder is not None
    for block in expanded.blocks:
        attn = block.attn2
        assert not attn.add_v_proj.weight.any() and not attn.add_v_proj.bias.any()
        assert attn.add_k_proj.weight.shape == (INNER_DIM, INNER_DIM) and attn.add_k_proj.weight.any()
        assert attn.norm_added_k is not None
    base_names = set(dict(t2v_transformer.named_parameters()))
    names = expanded_parameter_names(expanded)
    new = set(dict(expanded.named_parameters())) - base_names
    assert set(names) == new | {"patch_embedding.weight", "patch_embedding.bias"}
    assert all(n.startswith(("condition_embedder.image_embedder.", "blocks.")) for n in new)
    assert sum(".attn2.add_v_proj." in n for n in names) == 2 * len(expanded.blocks)
    with pytest.raises(ValueError, match="already"):
        expand_t2v_for_e2v(expanded, 20, CLIP_HIDDEN)


def test_expanded_parts_train_and_save(t2v_transformer, tmp_path):
    expanded = expand_t2v_for_e2v(t2v_transformer, 20, CLIP_HIDDEN).requires_grad_(True)
    latents, condition, text, image, timestep = transformer_inputs(20, CLIP_TOKENS)
    expanded(torch.cat([latents, condition], dim=1), timestep, text,
             encoder_hidden_states_image=image).sample.square().mean().backward()
    assert expanded.patch_embedding.weight.grad[:, 16:].abs().sum() > 0
    assert expanded.blocks[0].attn2.add_v_proj.weight.grad.abs().sum() > 0
    expanded.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
    assert loaded.config.in_channels == 36 and loaded.config.image_dim == CLIP_HIDDEN
    # an I2V-architecture transformer: what WanImageToVideoPipeline loads
    assert detect_variant({"_class_name": "WanImageToVideoPipeline"}, dict(loaded.config), {"z_dim": 16}) is \
        WanVariant.I2V
    for name, parameter in loaded.state_dict().items():
        assert torch.equal(parameter, expanded.state_dict()[name]), name
    half = expand_t2v_for_e2v(make_transformer(SPECS["wan2.1-t2v"], 0).to(torch.bfloat16), 20, CLIP_HIDDEN)
    assert half.blocks[0].attn2.add_k_proj.weight.dtype == torch.bfloat16
    assert half.condition_embedder.image_embedder.norm1.weight.dtype == torch.float32   # kept in fp32 as diffusers does

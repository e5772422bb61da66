"""Elements-to-Video condition tensors (DESIGN.md section 6), shared by the data loader, the training setup and the
sampler: element preprocessing, the pixel mini-video, the VAE condition (combine 'before' / 'after'), frame
conditioning with a VAE-free training step, CLIP tokens, the target video and the reference loss mask.

Slots: element k (position k) is slot k. Its reference frames start at the sum of the repeats of slots 0..k-1; a
missing element (None) leaves its slot empty (frames 0 = mid-grey, mask 0) and never shifts the others.

The VAE, normalisation and mask folding are WanModel's (`encode_video`, `normalize_latents`, `fold_frame_mask`,
`make_condition`): this module only arranges frames and latents.

Cheap frame conditioning (`encode_condition_cache` / `condition_from_cache`) is EXACT: a training step assembles the
same condition `make_e2v_condition` would compute for the kept slots, without a VAE call.
- combine 'after': each slot is encoded alone, so the cache holds one 1-frame latent per present slot plus the
  grey-frame latent; any kept subset is a selection of these.
- combine 'before': the causal VAE makes latent frame t depend on every pixel frame before it, so the latents of a
  mini-video with slot j dropped differ from the full encode's on all latent frames >= j's (the tail of grey frames
  after the last reference differs as well). Masking one full encode per slot would be an approximation; instead
  the cache holds one encode of the mini-video per subset that `frame_conditioning` can draw: one for `full`,
  `index`, `prefix` and `first_and_last` (deterministic given which slots are present), 2^n - 1 for `random` over
  n present slots (7 for three elements). The mask is rebuilt from the kept slots and the repeats.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import product

import cv2
import numpy as np
import torch
from PIL import Image
from torch import Tensor

PREPROCESS_MODES = ("resize", "center_crop", "pad_white", "letterbox", "a2", "a2_pad", "a2_crop")
FRAME_CONDITIONING_MODES = ("full", "index", "prefix", "random", "first_and_last")
_INTERPOLATION = {"bicubic": cv2.INTER_CUBIC, "bilinear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA,
                  "nearest": cv2.INTER_NEAREST}
# part of the element caches' key: bump when the pixels an element becomes change for the same settings
ELEMENT_PREPROCESS_VERSION = 2   # 2: shrinking averages (INTER_AREA) instead of sampling; the a2 modes


# --- element images --------------------------------------------------------------------------------------------

def a2_mode(mode: str, slot: int, pathway: str) -> str:
    """`a2` is SkyReels-A2's own choice (infer.py): its CLIP images are all padded with white; its VAE images are
    padded for the first two references (subject, object) and centre-cropped from the third (the background)."""
    if mode != "a2":
        return mode
    return "a2_pad" if pathway == "clip" or slot < 2 else "a2_crop"


def preprocess_element(image: np.ndarray, height: int, width: int, mode: str, reshape_mode: str = "bicubic"
                       ) -> np.ndarray:
    """uint8 (H, W, 3) RGB -> uint8 (height, width, 3).

    resize: stretch to the size; center_crop: scale to cover, crop the centre; pad_white / letterbox: scale to fit
    inside, centred on white / black bars. Shrinking averages over each output pixel's area (cv2.INTER_AREA, no
    aliasing on large reference photos); enlarging uses `reshape_mode`.
    a2_pad / a2_crop reproduce SkyReels-A2's inference preprocessing (models/utils.py): white bars added (or the
    centre cut) at the source size to the target aspect, each bar int()-truncated as A2 does, then PIL's bicubic
    resize, which is antialiased when shrinking. `a2` must be resolved per slot and pathway first (`a2_mode`)."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 (H, W, 3) image, got {image.dtype} {tuple(image.shape)}")
    if mode not in PREPROCESS_MODES or mode == "a2":
        raise ValueError(f"unknown preprocess mode {mode!r}; one of {', '.join(PREPROCESS_MODES)} ('a2' resolved "
                         f"by a2_mode)")
    if reshape_mode not in _INTERPOLATION:
        raise ValueError(f"unknown reshape_mode {reshape_mode!r}; one of {', '.join(_INTERPOLATION)}")
    interpolation = _INTERPOLATION[reshape_mode]
    src_h, src_w = image.shape[:2]
    if mode in ("a2_pad", "a2_crop"):
        return _a2_preprocess(image, height, width, pad=mode == "a2_pad")
    if mode == "resize":
        return _resize(image, height, width, interpolation)
    if mode == "center_crop":
        scale = max(height / src_h, width / src_w)
        new_h, new_w = max(height, round(src_h * scale)), max(width, round(src_w * scale))
        scaled = _resize(image, new_h, new_w, interpolation)
        top, left = (new_h - height) // 2, (new_w - width) // 2
        return np.ascontiguousarray(scaled[top:top + height, left:left + width])
    scale = min(height / src_h, width / src_w)
    new_h, new_w = min(height, max(1, round(src_h * scale))), min(width, max(1, round(src_w * scale)))
    canvas = np.full((height, width, 3), 255 if mode == "pad_white" else 0, dtype=np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas[top:top + new_h, left:left + new_w] = _resize(image, new_h, new_w, interpolation)
    return canvas


def _resize(image: np.ndarray, height: int, width: int, interpolation: int) -> np.ndarray:
    src_h, src_w = image.shape[:2]
    if (src_h, src_w) == (height, width):
        return image.copy()
    if height <= src_h and width <= src_w:
        interpolation = cv2.INTER_AREA   # shrinking: sampling (cubic, linear, nearest) aliases fine detail
    return cv2.resize(image, (width, height), interpolation=interpolation)


def _a2_preprocess(image: np.ndarray, height: int, width: int, pad: bool) -> np.ndarray:
    src_h, src_w = image.shape[:2]
    wider = src_h / src_w < height / width    # the source is wider than the target aspect
    if pad:
        if wider:   # white bars above and below
            bar = int((height / width * src_w - src_h) / 2.0)
            canvas = np.full((src_h + 2 * bar, src_w, 3), 255, np.uint8)
            canvas[bar:bar + src_h] = image
        else:       # white bars left and right
            bar = int((width / height * src_h - src_w) / 2.0)
            canvas = np.full((src_h, src_w + 2 * bar, 3), 255, np.uint8)
            canvas[:, bar:bar + src_w] = image
    elif wider:     # cut the sides
        kept = int(src_h / height * width)
        left = (src_w - kept) // 2
        canvas = image[:, left:left + kept]
    else:           # cut top and bottom
        kept = int(src_w / width * height)
        top = (src_h - kept) // 2
        canvas = image[top:top + kept]
    resized = Image.fromarray(np.ascontiguousarray(canvas)).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(resized).copy()


def element_to_tensor(image: np.ndarray) -> Tensor:
    """uint8 (H, W, 3) -> float (3, H, W) in [-1, 1]."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 127.5 - 1.0


# --- the pixel mini-video --------------------------------------------------------------------------------------

def slot_starts(repeats: Sequence[int]) -> list[int]:
    """First pixel frame of each slot: the sum of the previous slots' repeats."""
    starts, total = [], 0
    for repeat in repeats:
        starts.append(total)
        total += repeat
    return starts


def pixel_frame_mask(slot_present: Sequence[bool], repeats: Sequence[int], num_frames: int) -> Tensor:
    """(F,) float: 1 on the frames of the present slots."""
    _check_slots(len(slot_present), repeats, num_frames)
    mask = torch.zeros(num_frames)
    for present, start, repeat in zip(slot_present, slot_starts(repeats), repeats):
        if present:
            mask[start:start + repeat] = 1
    return mask


def build_mini_video(elements: Sequence[Tensor | None], repeats: Sequence[int], num_frames: int, *,
                     height: int | None = None, width: int | None = None) -> tuple[Tensor, Tensor]:
    """Elements in slot order, each (3, H, W) or (B, 3, H, W) in [-1, 1] or None (missing) -> (video, pixel_mask):
    video (3, F, H, W) (or (B, 3, F, H, W)) with slot k's element on `repeats[k]` consecutive frames from
    sum(repeats[:k]), 0 (mid-grey) elsewhere; pixel_mask (F,) 1 on the present elements' frames.
    `height`/`width` give the size when every element is missing."""
    _check_slots(len(elements), repeats, num_frames)
    present = [element for element in elements if element is not None]
    if present:
        like = present[0]
        if any(element.shape != like.shape for element in present):
            raise ValueError(f"elements differ in shape: {[tuple(e.shape) for e in present]}")
        if like.shape[-3] != 3 or like.dim() not in (3, 4):
            raise ValueError(f"an element must be (3, H, W) or (B, 3, H, W), got {tuple(like.shape)}")
        lead, (height, width) = tuple(like.shape[:-3]), like.shape[-2:]
        video = like.new_zeros(*lead, 3, num_frames, height, width)
    else:
        if height is None or width is None:
            raise ValueError("every element is missing: pass height and width")
        video = torch.zeros(3, num_frames, height, width)
    for element, start, repeat in zip(elements, slot_starts(repeats), repeats):
        if element is not None:
            video[..., start:start + repeat, :, :] = element.unsqueeze(-3)
    mask = pixel_frame_mask([element is not None for element in elements], repeats, num_frames)
    return video, mask.to(video.device)


def _check_slots(count: int, repeats: Sequence[int], num_frames: int) -> None:
    if len(repeats) != count:
        raise ValueError(f"{count} slots but {len(repeats)} repeats")
    if any(repeat < 1 for repeat in repeats):
        raise ValueError(f"every repeat must be >= 1, got {list(repeats)}")
    if sum(repeats) > num_frames:
        raise ValueError(f"the reference frames ({' + '.join(map(str, repeats))} = {sum(repeats)}) do not fit "
                         f"{num_frames} frames")


def num_latent_frames(model, num_frames: int) -> int:
    stride = model.vae_temporal_stride
    if num_frames < 1 or (num_frames - 1) % stride:
        raise ValueError(f"{num_frames} frames is not {stride}k+1")
    return (num_frames - 1) // stride + 1


# --- the VAE condition -----------------------------------------------------------------------------------------

def _as_batch(elements: Sequence[Tensor | None]) -> tuple[list[Tensor | None], bool]:
    present = [element for element in elements if element is not None]
    batched = bool(present) and present[0].dim() == 4
    return [None if e is None else (e if batched else e.unsqueeze(0)) for e in elements], batched


def encode_single_frames(model, frames: Tensor) -> Tensor:
    """(N, 3, H, W) in [-1, 1] -> normalised 1-frame latents (N, z, 1, h, w), each frame encoded alone."""
    return model.normalize_latents(model.encode_video(frames.unsqueeze(2)).float())


def encode_slot_latents(model, elements: Sequence[Tensor | None], *, height: int | None = None,
                        width: int | None = None) -> tuple[dict[int, Tensor], Tensor]:
    """combine 'after': ({slot: (B, z, 1, h, w)} for the present slots, grey (B, z, 1, h, w)), every element and one
    grey (0) frame encoded alone, in one VAE call. Elements (B, 3, H, W) or None."""
    slots = [k for k, element in enumerate(elements) if element is not None]
    if slots:
        like = elements[slots[0]]
        batch, height, width = like.shape[0], like.shape[-2], like.shape[-1]
        grey = like.new_zeros(batch, 3, height, width)
    else:
        if height is None or width is None:
            raise ValueError("every element is missing: pass height and width")
        batch, grey = 1, torch.zeros(1, 3, height, width)
    latents = encode_single_frames(model, torch.cat([elements[k] for k in slots] + [grey]))
    chunks = latents.split(batch)
    return dict(zip(slots, chunks[:-1])), chunks[-1]


def assemble_after_condition(model, slot_latents: dict[int, Tensor], grey_latent: Tensor, num_frames: int,
                             concatenate_mask: bool = True) -> Tensor:
    """combine 'after': latent frame k holds slot k's latent, every other latent frame the grey latent; the mask is 1
    (all `stride` channels) on exactly the filled latent frames. Inputs (B, z, 1, h, w) -> (B, C, T, h, w)."""
    frames = num_latent_frames(model, num_frames)
    outside = [slot for slot in slot_latents if slot >= frames]
    if outside:
        raise ValueError(f"slot(s) {outside} have no latent frame in a {num_frames}-frame clip ({frames} latent "
                         f"frames)")
    latents = grey_latent.expand(-1, -1, frames, -1, -1).clone()
    batch, _, _, height, width = latents.shape
    mask = latents.new_zeros(batch, model.vae_temporal_stride, frames, height, width)
    for slot, latent in slot_latents.items():
        latents[:, :, slot] = latent[:, :, 0]
        mask[:, :, slot] = 1
    return torch.cat([mask, latents], dim=1) if concatenate_mask else latents


def make_e2v_condition(model, elements: Sequence[Tensor | None], repeats: Sequence[int], num_frames: int,
                       combine: str = "before", concatenate_mask: bool = True, *, height: int | None = None,
                       width: int | None = None) -> Tensor:
    """The E2V condition for the elements in slot order ((3, H, W) or (B, 3, H, W) in [-1, 1], None = empty slot):
    (C, T, h, w), or (B, C, T, h, w) for batched elements; C = stride + z with `concatenate_mask`, else z.

    before: the mini-video (`build_mini_video`) through `model.make_condition` (VAE mean, per-channel normalised,
    mask folded as Wan I2V). after: each element encoded alone and placed at latent frame = its slot, grey-frame
    latents elsewhere, the mask 1 on exactly those latent frames."""
    batch_elements, batched = _as_batch(elements)
    if combine == "before":
        video, mask = build_mini_video(batch_elements, repeats, num_frames, height=height, width=width)
        if video.dim() == 4:
            video = video.unsqueeze(0)
        condition = model.make_condition(video, mask.unsqueeze(0).expand(video.shape[0], -1))
        if not concatenate_mask:
            condition = condition[:, model.vae_temporal_stride:]
    elif combine == "after":
        _check_slots(len(elements), repeats, num_frames)
        slot_latents, grey = encode_slot_latents(model, batch_elements, height=height, width=width)
        condition = assemble_after_condition(model, slot_latents, grey, num_frames, concatenate_mask)
    else:
        raise ValueError(f"unknown combine {combine!r}; 'before' or 'after'")
    return condition if batched else condition[0]


# --- frame conditioning ----------------------------------------------------------------------------------------

def apply_frame_conditioning(slot_present: Sequence[bool], mode: str, frame_index: int = 0,
                             generator: torch.Generator | None = None) -> list[bool]:
    """Which present slots a training step keeps (the others become empty):
    full: all; index: slot `frame_index` only (none when it is missing); prefix: slots 0..frame_index;
    random: a uniformly drawn non-empty subset of the present slots; first_and_last: the first and the last present
    slot. At sampling every given reference is used (mode 'full')."""
    present = [bool(p) for p in slot_present]
    if mode == "full":
        return present
    if mode == "index":
        return [p and k == frame_index for k, p in enumerate(present)]
    if mode == "prefix":
        return [p and k <= frame_index for k, p in enumerate(present)]
    indices = [k for k, p in enumerate(present) if p]
    if mode == "first_and_last":
        keep = {indices[0], indices[-1]} if indices else set()
        return [k in keep for k in range(len(present))]
    if mode == "random":
        if not indices:
            return present
        # a uniform draw over the 2^n - 1 non-empty subsets of the n present slots
        bits = int(torch.randint(1, 2 ** len(indices), (1,), generator=generator))
        keep = {slot for i, slot in enumerate(indices) if bits >> i & 1}
        return [k in keep for k in range(len(present))]
    raise ValueError(f"unknown frame_conditioning {mode!r}; one of {', '.join(FRAME_CONDITIONING_MODES)}")


def condition_subsets(slot_present: Sequence[bool], mode: str, frame_index: int = 0) -> list[tuple[bool, ...]]:
    """Every kept-slot subset `apply_frame_conditioning` can return for these present slots."""
    present = [bool(p) for p in slot_present]
    if mode != "random":
        return [tuple(apply_frame_conditioning(present, mode, frame_index))]
    indices = [k for k, p in enumerate(present) if p]
    if not indices:
        return [tuple(present)]
    subsets = []
    for choice in product((False, True), repeat=len(indices)):
        if any(choice):
            keep = {slot for slot, chosen in zip(indices, choice) if chosen}
            subsets.append(tuple(k in keep for k in range(len(present))))
    return subsets


def subset_key(kept: Sequence[bool]) -> str:
    return "".join("1" if k else "0" for k in kept)


def encode_condition_cache(model, elements: Sequence[Tensor | None], repeats: Sequence[int], num_frames: int,
                           combine: str, frame_conditioning: str = "full", frame_index: int = 0
                           ) -> dict[str, Tensor]:
    """For one item (elements (3, H, W) or None, slot order): the tensors a training step needs to build the
    condition for any kept subset without a VAE call (see the module docstring). Safetensors-ready:
    after -> {"grey": (z, 1, h, w), "slot.K": (z, 1, h, w) per present slot};
    before -> {"subset.<bits>": latents (z, T, h, w) per subset `frame_conditioning` can draw}."""
    if any(element is not None and element.dim() != 3 for element in elements):
        raise ValueError("the condition cache is per item: elements must be (3, H, W)")
    _check_slots(len(elements), repeats, num_frames)
    present = [element for element in elements if element is not None]
    if not present:
        raise ValueError("an E2V item needs at least one element")
    height, width = present[0].shape[-2:]
    if combine == "after":
        batch_elements, _ = _as_batch(elements)
        slot_latents, grey = encode_slot_latents(model, batch_elements)
        cache = {"grey": grey[0]}
        cache.update({f"slot.{k}": latent[0] for k, latent in slot_latents.items()})
        return cache
    if combine != "before":
        raise ValueError(f"unknown combine {combine!r}; 'before' or 'after'")
    cache = {}
    for kept in condition_subsets([e is not None for e in elements], frame_conditioning, frame_index):
        kept_elements = [element if keep else None for element, keep in zip(elements, kept)]
        cache[f"subset.{subset_key(kept)}"] = make_e2v_condition(model, kept_elements, repeats, num_frames, "before",
                                                                 concatenate_mask=False, height=height, width=width)
    return cache


def condition_from_cache(model, cache: dict[str, Tensor], kept: Sequence[bool], repeats: Sequence[int],
                         num_frames: int, combine: str, concatenate_mask: bool = True) -> Tensor:
    """The condition (C, T, h, w) for the kept slots, from `encode_condition_cache`'s tensors; no VAE call (the model
    gives only the temporal stride and the mask folding). Equal to `make_e2v_condition` on the kept elements."""
    if combine == "after":
        missing = [k for k, keep in enumerate(kept) if keep and f"slot.{k}" not in cache]
        if missing:
            raise KeyError(f"slot(s) {missing} are kept but the cache holds no latent for them (element missing)")
        slot_latents = {k: cache[f"slot.{k}"].unsqueeze(0) for k, keep in enumerate(kept) if keep}
        return assemble_after_condition(model, slot_latents, cache["grey"].unsqueeze(0), num_frames,
                                        concatenate_mask)[0]
    if combine != "before":
        raise ValueError(f"unknown combine {combine!r}; 'before' or 'after'")
    key = f"subset.{subset_key(kept)}"
    if key not in cache:
        raise KeyError(f"the condition cache holds no encode for kept slots {subset_key(kept)} (has "
                       f"{sorted(cache)}); was it built for another frame_conditioning?")
    latents = cache[key]
    if not concatenate_mask:
        return latents
    pixel_mask = pixel_frame_mask(kept, repeats, num_frames).to(device=latents.device, dtype=latents.dtype)
    mask = model.fold_frame_mask(pixel_mask.unsqueeze(0), latents.shape[-2], latents.shape[-1])[0]
    return torch.cat([mask, latents], dim=0)


# --- CLIP pathway ----------------------------------------------------------------------------------------------

def clip_tokens(model, images: Sequence[np.ndarray]) -> Tensor:
    """CLIP hidden_states[-2] of each element image (uint8 (H, W, 3), already preprocessed at
    processors.clip.resolution), concatenated in position order: (N * tokens, dim), for `encoder_hidden_states_image`
    (add the batch dimension)."""
    if not images:
        return torch.zeros(0, model.image_encoder.config.hidden_size)
    tokens = model.encode_image(list(images))
    return tokens.reshape(-1, tokens.shape[-1])


# --- training target and loss mask -----------------------------------------------------------------------------

def target_video_with_references(mini_video: Tensor, pixel_mask: Tensor, clip_video: Tensor, n_ref_frames: int,
                                 mode: str = "prepend") -> Tensor:
    """The training target ((3, F, H, W) or (B, 3, F, H, W), F = the mini-video's frames).
    prepend: the mini-video's first `n_ref_frames` frames (every slot, empty ones grey) followed by the clip's first
    F - n_ref_frames frames, so the target's leading latent frames are the references as in A2; overlay: the clip's
    first F frames unchanged."""
    frames = mini_video.shape[-3]
    if mode == "overlay":
        n_ref_frames = 0
    elif mode != "prepend":
        raise ValueError(f"unknown reference_frames {mode!r}; 'prepend' or 'overlay'")
    if not 0 <= n_ref_frames <= frames:
        raise ValueError(f"{n_ref_frames} reference frames do not fit {frames} frames")
    if mode == "prepend" and bool(pixel_mask[n_ref_frames:].any()):
        raise ValueError(f"the pixel mask marks reference frames after the first {n_ref_frames}")
    needed = frames - n_ref_frames
    if clip_video.shape[-3] < needed:
        raise ValueError(f"the clip has {clip_video.shape[-3]} frames; the target needs {needed}")
    clip = clip_video[..., :needed, :, :].to(mini_video)
    return torch.cat([mini_video[..., :n_ref_frames, :, :], clip], dim=-3)


def reference_latent_frames(n_ref_frames: int, stride: int = 4) -> int:
    """Latent frames that hold at least one of the first `n_ref_frames` pixel frames (frame 0 alone, then chunks
    of `stride`): 1, 4, 4 -> 3; 4, 4, 4 (12 frames) -> 4."""
    return 0 if n_ref_frames <= 0 else 1 + -(-(n_ref_frames - 1) // stride)


def reference_loss_mask(num_latent_frames: int, n_ref_latent_frames: int, include: bool | str = True) -> Tensor:
    """(1, 1, T, 1, 1) loss weights: ones, or (`include` false / 'exclude') zeros on the first
    `n_ref_latent_frames` latent frames."""
    if isinstance(include, str):
        if include not in ("include", "exclude"):
            raise ValueError(f"unknown reference_loss {include!r}; 'include' or 'exclude'")
        include = include == "include"
    mask = torch.ones(1, 1, num_latent_frames, 1, 1)
    if not include:
        mask[:, :, :n_ref_latent_frames] = 0
    return mask


# --- element inputs, shared by the data loader and the sampler ---------------------------------------------------

def prepare_element_inputs(dataset, images: Sequence[np.ndarray | None], height: int, width: int
                           ) -> tuple[list[Tensor | None], list[np.ndarray]]:
    """Element images (uint8 (H, W, 3) or None, in position order) -> the VAE pathway's element tensors at the clip's
    (height, width) and the CLIP pathway's images at processors.clip.resolution (present elements with CLIP on),
    each preprocessed with its element's mode. `dataset` is an E2VDatasetConfig."""
    order = dataset.elements_in_position_order()
    vae_elements = [None if image is None else element_to_tensor(preprocess_element(
        image, height, width, a2_mode(dataset.vae_preprocess(element), slot, "vae"), dataset.reshape_mode))
        for slot, (element, image) in enumerate(zip(order, images))]
    clip_height, clip_width = dataset.processors.clip.resolution
    clip_images = [preprocess_element(image, clip_height, clip_width,
                                      a2_mode(dataset.clip_preprocess(element), slot, "clip"), dataset.reshape_mode)
                   for slot, (element, image) in enumerate(zip(order, images))
                   if image is not None and dataset.clip_preprocess(element)]
    return vae_elements, clip_images

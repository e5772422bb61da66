"""Captions images and videos with a Qwen2.5-VL class vision-language model through transformers.

Video frames are sampled evenly and shown to the model as a sequence of images: transformers' video processor needs
torchvision, which this project does not install, while its image processor (PIL backend) does not. The processor
class (Qwen2_5_VLProcessor) cannot be built without a video processor either, so this class does what it does for
images: the chat template writes one <|image_pad|> per picture, and each is widened to the number of merged patches
the image processor made for that picture.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_PROMPT = ("Describe this {kind} in one detailed paragraph for training a video model: the subjects, what "
                  "they do, the setting, the lighting, the camera and its movement, and the style.")


class ModelNotAvailableError(Exception):
    """The model is neither a local folder nor in the Hugging Face cache, and downloads are off."""


# how a refusal names the model option and the way to allow a download: the command line's flags here; the window
# passes its own field and tick box (modules/ui/CaptionController.py)
CLI_NAMES = {"model": "--model", "allow": "allow the download with --allow-download"}


def _resolve(model: str, allow_download: bool, names: dict = CLI_NAMES) -> tuple[str, bool]:
    """(what from_pretrained gets, local_files_only); ModelNotAvailableError with the remedy when it cannot load."""
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ModelNotAvailableError(f"{names['model']} {model}: the folder has no config.json (a transformers "
                                         f"model folder has config.json, the weights, the tokenizer and "
                                         f"preprocessor_config.json)")
        return model, True
    if allow_download:
        return model, False
    from huggingface_hub import try_to_load_from_cache
    cached = try_to_load_from_cache(model, "config.json")
    if not isinstance(cached, str):
        raise ModelNotAvailableError(
            f"{names['model']} {model}: not a local folder and not in the Hugging Face cache, and downloads are off. "
            f"Pass a local model folder, or {names['allow']} (Qwen2.5-VL-7B is about 16 GB).")
    return model, True


def fit_pixels(frame: np.ndarray, max_pixels: int) -> Image.Image:
    """A uint8 (H, W, 3) frame as a PIL image shrunk (aspect kept) to at most `max_pixels` pixels: the number of
    vision tokens grows with the pixels, so large frames are scaled down before the processor sees them."""
    image = Image.fromarray(frame)
    scale = (max_pixels / (image.width * image.height)) ** 0.5
    if scale < 1:
        image = image.resize((max(28, round(image.width * scale)), max(28, round(image.height * scale))),
                             Image.Resampling.BICUBIC)
    return image


class QwenVLCaptioner:
    def __init__(self, model: str = DEFAULT_MODEL, allow_download: bool = False, device: str | None = None,
                 dtype: torch.dtype | None = None, max_new_tokens: int = 160, names: dict = CLI_NAMES):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        name, local_only = _resolve(model, allow_download, names)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
            self.image_processor = AutoImageProcessor.from_pretrained(name, local_files_only=local_only)
            self.model = AutoModelForImageTextToText.from_pretrained(name, local_files_only=local_only, dtype=dtype)
        except OSError as error:  # a partial cache, or a hub id that does not exist
            raise ModelNotAvailableError(f"--model {model}: cannot load it ({error})") from error
        self.model.to(self.device).eval()
        self.tokenizer.padding_side = "left"   # generation continues every row at its end
        self.image_token = "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id != self.model.config.image_token_id:
            raise ModelNotAvailableError(f"--model {model}: the tokenizer's {self.image_token} is id "
                                         f"{self.image_token_id}, the model expects {self.model.config.image_token_id}")
        self.chat_template = self.tokenizer.chat_template or self._folder_chat_template(name)
        if not self.chat_template:
            raise ModelNotAvailableError(f"--model {model}: no chat template (tokenizer_config.json, "
                                         f"chat_template.jinja or chat_template.json)")
        self.max_new_tokens = max_new_tokens

    @staticmethod
    def _folder_chat_template(name: str) -> str | None:
        """A processor's template (chat_template.json / .jinja beside the weights), when the tokenizer has none."""
        import json
        folder = Path(name)
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.json").is_file():
            return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return None

    def _prompt_text(self, pictures: int, prompt: str) -> str:
        content = [{"type": "image"}] * pictures + [{"type": "text", "text": prompt}]
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  chat_template=self.chat_template, add_generation_prompt=True,
                                                  tokenize=False)

    @torch.no_grad()
    def caption(self, items: Sequence[tuple[list[Image.Image], str]]) -> list[str]:
        """One caption per (pictures, prompt) item, generated as one batch (greedy: the same input gives the same
        caption)."""
        pictures = [picture for item_pictures, _ in items for picture in item_pictures]
        vision = self.image_processor(images=pictures, return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        tokens_per_picture = iter((vision["image_grid_thw"].prod(dim=-1) // merge).tolist())
        texts = []
        for item_pictures, prompt in items:
            text = self._prompt_text(len(item_pictures), prompt)
            parts = text.split(self.image_token)
            if len(parts) != len(item_pictures) + 1:
                raise ValueError(f"the chat template wrote {len(parts) - 1} image markers for {len(item_pictures)} "
                                 f"pictures")
            texts.append(parts[0] + "".join(self.image_token * next(tokens_per_picture) + part for part in parts[1:]))
        batch = self.tokenizer(texts, return_tensors="pt", padding=True)
        input_ids = batch["input_ids"]
        mm_token_type_ids = (input_ids == self.image_token_id).int()   # 1 marks image tokens (3D rope positions)
        output = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=batch["attention_mask"].to(self.device),
            mm_token_type_ids=mm_token_type_ids.to(self.device),
            pixel_values=vision["pixel_values"].to(self.device, self.model.dtype),
            image_grid_thw=vision["image_grid_thw"].to(self.device),
            max_new_tokens=self.max_new_tokens, do_sample=False)
        new_tokens = output[:, input_ids.shape[1]:]
        return [text.strip() for text in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def caption_folder(captioner, targets, prompt: str, frames: int, max_pixels: int, batch_size: int, prefix: str,
                   progress: Callable[[int, int], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> tuple[int, list[str]]:
    """Captions `targets` in batches, writing each caption as its batch finishes (so a stopped run resumes where it
    stopped); `stop` is asked before each batch. Unreadable media are skipped with one warning each. Returns
    (written, the skipped files' reasons)."""
    from modules.captioning.caption_targets import evenly_spaced, format_prompt, write_caption
    from modules.util.video_io import UnreadableMediaError, probe_media, read_frames

    written, skipped, done = 0, [], 0
    for start in range(0, len(targets), batch_size):
        if stop and stop():
            break
        batch, loaded = targets[start:start + batch_size], []
        for target in batch:
            try:
                info = probe_media(target.media)
                indices = evenly_spaced(info.frame_count, 1 if target.kind == "image" else frames)
                pictures = [fit_pixels(f, max_pixels) for f in read_frames(target.media, indices, info)]
            except (UnreadableMediaError, ValueError, IndexError) as error:
                log.warning("skipped %s: %s", target.media, error)
                skipped.append(f"{target.media}: {error}")
                continue
            loaded.append((target, pictures, format_prompt(prompt, target, len(pictures))))
        if loaded:
            captions = captioner.caption([(pictures, text) for _, pictures, text in loaded])
            for (target, _, _), caption in zip(loaded, captions):
                write_caption(target, caption, prefix)
                written += 1
        done += len(batch)
        if progress:
            progress(done, len(targets))
    return written, skipped

"""Preview videos during training: every enabled sample of `config.sampling.samples_file`, written as

    <workspace>/samples/<run>/<index>-<prompt slug>/<step>-<epoch>.mp4   H.264 yuv420p at the model's native fps
    <workspace>/samples/<run>/<index>-<prompt slug>/<step>-<epoch>.png   the first, middle and last frames side by side

plus an animated GIF per sample in TensorBoard. Called between optimizer steps; WanModelSampler leaves the training
state as it found it (modes, requires_grad, adapters, devices, RNGs). The samples file is read again at every call,
so it can be edited while training runs.
"""
from __future__ import annotations

import io
import json
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from modules.model.released_parts import remember_prompts, text_encoder_loaded
from modules.modelSampler.stack_check import FULL_STEPS_SUFFIX, StackCheck, stack_distance
from modules.modelSampler.WanModelSampler import SampleResult, WanModelSampler
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.kill_points import phase
from modules.util.sample_definitions import load_sample_definitions

logger = logging.getLogger(__name__)


def prompt_slug(prompt: str, max_length: int = 40) -> str:
    """A file-name-safe slug: lower-case ASCII letters and digits joined by '-'; 'sample' when nothing is left."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:max_length].strip("-")
    return slug or "sample"


def frame_strip(frames: np.ndarray) -> np.ndarray:
    """uint8 (F, H, W, 3) -> the first, middle and last frames side by side (H, 3W, 3); one frame: (H, W, 3)."""
    picks = sorted({0, len(frames) // 2, len(frames) - 1})
    return np.concatenate([frames[i] for i in picks], axis=1)


GIF_MAX_SIDE = 320  # TensorBoard GIFs are scaled down to this: a full 832x480x81 GIF is tens of MB per preview


def gif_bytes(frames: np.ndarray, fps: float, max_side: int | None = GIF_MAX_SIDE) -> bytes:
    """uint8 (F, H, W, 3) -> an animated, looping GIF, scaled (aspect kept) so its longer side is at most
    `max_side`."""
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    height, width = frames.shape[1:3]
    if max_side and max(height, width) > max_side:
        scale = max_side / max(height, width)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        images = [image.resize(size, Image.Resampling.BILINEAR) for image in images]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)),
                   loop=0, optimize=False)
    return buffer.getvalue()


def preview_step(path: Path) -> int:
    """The step of a preview named `<step>-<epoch>.mp4` (-1 for another name): previews order by it, not by
    string ('50-8' comes before '200-33')."""
    head = path.stem.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def add_gif_summary(writer, tag: str, frames: np.ndarray, fps: float, step: int) -> None:
    """An image summary whose encoded bytes are a GIF: TensorBoard's image plugin shows it animated. (SummaryWriter's
    add_video needs moviepy < 2, which this project does not install.)"""
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    data = gif_bytes(frames, fps)
    with Image.open(io.BytesIO(data)) as gif:
        width, height = gif.size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=data)
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


@dataclass
class TrainingSample:
    index: int                    # position in the samples file (stable when others are disabled)
    sample: SampleConfig          # with the training config's defaults filled in

    @property
    def folder_name(self) -> str:
        return f"{self.index}-{prompt_slug(self.sample.prompt)}"


@dataclass
class PreviewOutput:
    index: int
    video: Path
    strip: Path
    seconds: float
    notes: list[str] = field(default_factory=list)


class PreviewOutOfStep(RuntimeError):
    """A preview failed on one rank while every rank computed it over a sharded model: the run cannot go on."""


class TrainingSampler:
    def __init__(self, trainer):
        from modules.util.ranks import is_main
        self.trainer = trainer
        self.failures = 0  # previews skipped because they failed
        self.stack_checks: list[StackCheck] = []   # every preview's stack check, for the run report
        # context parallel: the other ranks of rank 0's group compute each preview with it and write nothing
        self.writes = is_main()
        # over a sharded (FSDP2) transformer every rank computes each preview with rank 0, in step: every forward
        # pass gathers each block from all ranks, so they must make the same passes in the same order
        parallel = getattr(trainer, "parallel", None)
        self.in_step = bool(parallel is not None and parallel.forward_needs_every_rank)

    @property
    def samples_dir(self) -> Path:
        # GenericTrainer gives each run its own folder; a caller without runs gets <workspace>/samples
        run_folder = getattr(self.trainer, "samples_dir", None)
        return run_folder if run_folder is not None else Path(self.trainer.config.workspace_dir) / "samples"

    def load_samples(self) -> list[TrainingSample]:
        """The enabled samples of the samples file, with the sampling section's steps / guidance / scheduler as
        defaults; [] when no samples file is configured."""
        sampling = self.trainer.config.sampling
        if not sampling.samples_file:
            return []
        samples = load_sample_definitions(sampling.samples_file)
        return [TrainingSample(index, sample.with_defaults(steps=sampling.steps, guidance=sampling.guidance,
                                                           scheduler=sampling.scheduler))
                for index, sample in enumerate(samples) if sample.enabled]

    def _accelerator(self):
        """sampling.accelerator read against the model (once: the files are checked before training starts); without
        one, a step-distilled base's own schedule (modules/util/distilled_base.py), said once; else None."""
        config = self.trainer.config.sampling.accelerator
        preserve = getattr(getattr(self.trainer, "setup", None), "preserve", None)
        if config.enabled and preserve is not None:   # distill.mode preserve trains with it: the same files, read once
            return preserve.accelerator
        if getattr(self, "_loaded_accelerator", False) is False:
            from modules.modelSampler.accelerator import load_accelerator, takes_accelerator
            from modules.util.distilled_base import distilled_base
            self._loaded_accelerator = None
            if config.enabled:
                self._loaded_accelerator = load_accelerator(self.trainer.model, config)
            elif takes_accelerator(self.trainer.model) and \
                    (found := distilled_base(self.trainer.config.model.base_model_name)) is not None:
                print(f"previews: the base is {found.describe()}", flush=True)
                self._loaded_accelerator = load_accelerator(self.trainer.model, found.schedule())
        return self._loaded_accelerator

    def _sampler(self, accelerated: bool = True) -> WanModelSampler:
        config = self.trainer.config
        return WanModelSampler(self.trainer.model, device=self.trainer.device,
                               autocast_dtype=config.train_dtype.torch_dtype(),
                               e2v_config=self.trainer.model.e2v_config,
                               accelerator=self._accelerator() if accelerated else None)

    @property
    def stack_checking(self) -> bool:
        """Each accelerated preview is also made at its full steps without the accelerator (distill.stack_check)."""
        config = self.trainer.config
        return config.sampling.accelerator.enabled and config.distill.mode == "base" and config.distill.stack_check

    def validate(self) -> list[str]:
        """Checks every enabled sample against the model before training starts (sizes rounded, images present,
        images only where the variant takes them): raises SampleDefinitionError / SampleError, returns the notes."""
        sampler = self._sampler()
        notes = []
        for item in self.load_samples():
            resolved, sample_notes = sampler.resolve(item.sample)
            notes += [f"sample {item.folder_name}: {note}" for note in sample_notes]
            self._check_splits(resolved)
        return notes

    def _check_splits(self, resolved) -> None:
        """Context parallel: a preview's tokens must divide over the group as a training clip's must."""
        from modules.util.ranks import context_parallel
        size = context_parallel()
        if size == 1:
            return
        from modules.modelSampler.WanModelSampler import SampleError
        from modules.planner.plan_shapes import resolve_architecture
        from modules.trainer.context_parallel import token_count
        tokens = token_count(resolve_architecture(self.trainer.config), resolved.frames, resolved.height,
                             resolved.width)
        if tokens % size:
            raise SampleError(f"a {resolved.frames}x{resolved.width}x{resolved.height} preview has {tokens} tokens, "
                              f"which do not divide over distributed.context_parallel {size}: choose another size")

    def _prompt(self, prompt: str) -> str:
        """Embedding training with several vectors: the placeholder stands for all of its tokens, as in training."""
        config = self.trainer.config
        if config.training_method is not TrainingMethod.EMBEDDING or config.embedding.vector_count < 2:
            return prompt
        from modules.modelSetup.WanEmbeddingSetup import placeholder_tokens
        tokens = placeholder_tokens(config.embedding.placeholder, config.embedding.vector_count)
        return prompt.replace(config.embedding.placeholder, " ".join(tokens))

    def sample_all(self) -> list[PreviewOutput]:
        """Generates and writes every enabled sample; returns what was written. A preview that fails (out of memory,
        an element file gone since the start) is logged and skipped: training goes on. In step over a sharded
        model, a preview that cannot run on one rank is skipped on all; one that fails while the ranks compute it
        stops the run (their collectives can no longer be matched)."""
        items = self._rank_0s() if self.in_step else self.load_samples_or_warn()
        if not items:
            return []
        writer = getattr(getattr(self.trainer, "hooks", None), "writer", None)
        sampler = self._sampler()
        full_sampler = self._sampler(accelerated=False) if self.stack_checking else None
        outputs = []
        with phase("sample"), self._text_ready(items):
            for item in items:
                if self.in_step and not self._runs_on_every_rank(sampler, item):
                    continue
                started = time.perf_counter()
                try:
                    results = self._generate(sampler, item, full_sampler)
                except Exception as error:  # noqa: BLE001  (any failure of a preview must not end the run)
                    if self.in_step:
                        raise PreviewOutOfStep(
                            f"preview {item.folder_name} failed on this rank while every rank computed it over the "
                            f"sharded model ({type(error).__name__}: {error}); the ranks' collectives can no longer "
                            f"be matched, so the run stops (resume from the last backup)") from error
                    self._skip_failed(item, error)
                    continue
                if not self.writes:
                    continue
                try:
                    outputs.append(self._write(sampler, item, results, writer, started))
                except Exception as error:  # noqa: BLE001  (a preview that cannot be written must not end the run)
                    self._skip_failed(item, error)
        if writer is not None:
            writer.flush()
        return outputs

    def _rank_0s(self) -> list[TrainingSample]:
        """Rank 0's reading of the samples file for every rank: the file may be edited while the ranks read it."""
        from modules.util.ranks import broadcast_json
        rows = broadcast_json([[item.index, item.sample.model_dump(mode="json")]
                               for item in self.load_samples_or_warn()] if self.writes else None)
        return [TrainingSample(index, SampleConfig(**sample)) for index, sample in rows]

    def _runs_on_every_rank(self, sampler: WanModelSampler, item: TrainingSample) -> bool:
        """Whether every rank can start this preview (its files are there, its inputs fit the model); else all
        skip it, before any of them enters a forward pass."""
        from modules.util.ranks import all_gather_json
        try:
            sampler.resolve(item.sample, log=False)
            problem = None
        except Exception as error:  # noqa: BLE001  (any reason this rank cannot start it: skipped on all)
            problem = f"{type(error).__name__}: {error}"
        problems = [(rank, p) for rank, p in enumerate(all_gather_json(problem)) if p is not None]
        if problems and self.writes:
            logger.warning("preview %s at step %d is skipped on every rank (training goes on): rank %d: %s",
                           item.folder_name, self.trainer.progress.global_step, *problems[0])
        if problems:
            self.failures += 1
        return not problems

    def remember_prompts(self, items: list[TrainingSample] | None = None) -> None:
        """Keeps the embeddings of the previews' prompts and negative prompts (released_parts), encoded on the
        training device as a preview would encode them."""
        items = self.load_samples() if items is None else items
        prompts = [p for item in items for p in (self._prompt(item.sample.prompt), item.sample.effective_negative_prompt)]
        remember_prompts(self.trainer.model, prompts, self.trainer.device)

    @contextmanager
    def _text_ready(self, items: list[TrainingSample]):
        """A preview round with a released text encoder reads it again only to keep the prompts the samples file
        gained; Animate-2, which encodes its prompts its own way, reads it for the round."""
        model = self.trainer.model
        if model.text_encoder is not None or model.text_encoder_loader is None:
            yield
        elif model.variant.takes_driving_video:
            with text_encoder_loaded(model):
                yield
        else:
            self.remember_prompts(items)
            yield

    def load_samples_or_warn(self) -> list[TrainingSample]:
        """The samples file is read again at every preview (it may be edited while training runs): a file that no
        longer parses skips this preview with a warning."""
        try:
            return self.load_samples()
        except Exception as error:  # noqa: BLE001
            logger.warning("previews at step %d skipped: the samples file cannot be read: %s",
                           self.trainer.progress.global_step, error)
            self.failures += 1
            return []

    def _skip_failed(self, item: TrainingSample, error: Exception) -> None:
        self._forget_failed_preview()
        logger.warning("preview %s at step %d failed and is skipped (training goes on): %s: %s",
                       item.folder_name, self.trainer.progress.global_step, type(error).__name__, error)
        self.failures += 1

    def _forget_failed_preview(self) -> None:
        """Frees what a failed preview (typically out of memory) left on the accelerator before training goes on."""
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _generate(self, sampler: WanModelSampler, item: TrainingSample,
                  full_sampler: WanModelSampler | None = None) -> dict[str, SampleResult]:
        """{file name suffix: result}: the preview (""); with `full_sampler` (the stack check) the same sample at its
        own steps and guidance without the accelerator, "-full"; with sampling.compare_strengths, the same sample with
        the LoRA being trained at each other strength (the adapters' scaling, put back after), "-x<strength>". Every
        rank that computes previews makes the same forward passes here, whether it writes or not."""
        from modules.util.lora.strength import adapter_strength

        sample = item.sample.model_copy(update={"prompt": self._prompt(item.sample.prompt)})
        results = {"": sampler.sample(sample)}
        if full_sampler is not None:   # the same seed: the same initial noise as the preview
            results[FULL_STEPS_SUFFIX] = full_sampler.sample(sample)
        config = self.trainer.config
        if config.training_method is not TrainingMethod.LORA:
            return results
        parts = [getattr(self.trainer.model, expert) for expert in ("transformer", "transformer_2")
                 if getattr(self.trainer.model, expert, None) is not None]
        for strength in config.sampling.compare_strengths:
            if strength == 1:
                continue  # the preview itself
            with adapter_strength(parts, strength):
                results[f"-x{strength:g}"] = sampler.sample(sample)
        return results

    def _write(self, sampler: WanModelSampler, item: TrainingSample, results: dict[str, SampleResult], writer,
               started: float) -> PreviewOutput:
        from PIL import Image

        from modules.util.atomic import atomic_path, atomic_write_text
        from modules.util.video_frames import write_video

        progress = self.trainer.progress
        step, epoch = int(progress.global_step), int(progress.epoch)
        result = results[""]
        check = self._stack_check(item, results, step)
        folder = self.samples_dir / item.folder_name
        video_path = folder / f"{step}-{epoch}.mp4"
        strip_path = folder / f"{step}-{epoch}.png"
        frames = result.frames_uint8()
        folder.mkdir(parents=True, exist_ok=True)
        write_video(video_path, frames, result.fps)
        with atomic_path(strip_path) as tmp:
            Image.fromarray(frame_strip(frames)).save(tmp, format="PNG")
        # the settings it was made with (prompt, seed, size): the GUI's gallery shows them on hover
        atomic_write_text(folder / f"{step}-{epoch}.json", json.dumps(
            {"step": step, "epoch": epoch, **result.sample.model_dump(mode="json"),
             **({"accelerator": result.accelerator} if result.accelerator is not None else {}),
             **({"stack_check": check.record()} if check is not None else {})}, indent=1) + "\n")
        if writer is not None:
            add_gif_summary(writer, f"samples/{item.folder_name}", frames, result.fps, step)
            if check is not None:
                writer.add_scalar(f"stack_check/{item.folder_name}", check.distance, step)
        for suffix, other in results.items():
            if suffix:
                other_frames = other.frames_uint8()
                write_video(folder / f"{step}-{epoch}{suffix}.mp4", other_frames, other.fps)
                if writer is not None:
                    add_gif_summary(writer, f"samples/{item.folder_name}/{suffix[1:]}", other_frames, other.fps,
                                    step)
        seconds = time.perf_counter() - started
        accelerated = "" if sampler.accelerator is None else f", {sampler.accelerator.describe()}"
        if check is not None:
            accelerated += (f"; stack check {check.distance:.4f} from the {check.full_steps}-step sample without it "
                            f"({folder / f'{step}-{epoch}{FULL_STEPS_SUFFIX}.mp4'})")
        print(f"preview {item.folder_name} at step {step}: {video_path} ({seconds:.1f} s{accelerated})", flush=True)
        if check is not None:
            self.stack_checks.append(check)
        return PreviewOutput(item.index, video_path, strip_path, seconds, result.notes)

    def _stack_check(self, item: TrainingSample, results: dict[str, SampleResult], step: int) -> StackCheck | None:
        full = results.get(FULL_STEPS_SUFFIX)
        if full is None:
            return None
        check = StackCheck(step, item.folder_name, stack_distance(results[""].latents, full.latents),
                           full.sample.steps, full.sample.guidance)
        return check

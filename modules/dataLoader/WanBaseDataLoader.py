"""Builds the data pipeline for a Wan model: scan -> probe -> frame window -> repeats -> resolution bucket ->
decode -> resize/crop -> caption settings -> VAE / text / image encoders (disk-cached) -> one-bucket batches.

The scan and probe stages run before any model loads (`scan`), so "no usable item" costs nothing; the encoders are
added once the model is there (`attach_model`)."""
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from modules.dataLoader.animate_scan import companion_set, scan_animate_concepts
from modules.dataLoader.companion_checks import blank_control_problems, control_report_line, unused_folder_problems
from modules.dataLoader.concept_scan import ScanResult, scan_concepts
from modules.dataLoader.e2v_scan import elements_as_vace_references, scan_e2v_dataset
from modules.dataLoader.validation_split import split_validation
from modules.dataLoader.pipeline.ApplyFrameConditioning import ApplyFrameConditioning
from modules.dataLoader.pipeline.EncodeAnimate import EncodeAnimate
from modules.dataLoader.pipeline.EncodeE2V import EncodeE2V
from modules.dataLoader.pipeline.EncodeMask import EncodeMask
from modules.util.config.DataConfig import ConceptConfig
from modules.dataLoader.DiskCache import DiskCache, cache_key
from modules.dataLoader.pipeline.ApplyConceptSettings import ApplyConceptSettings
from modules.dataLoader.pipeline.BucketBatch import BucketBatch
from modules.dataLoader.pipeline.RankBucketBatch import RankBucketBatch
from modules.dataLoader.pipeline.EncodeText import EncodeText
from modules.dataLoader.pipeline.EncodeVideo import EncodeVideo
from modules.dataLoader.pipeline.FrameWindow import FrameWindow
from modules.dataLoader.pipeline.ListSource import ListSource
from modules.dataLoader.pipeline.LoadVideo import LoadVideo
from modules.dataLoader.pipeline.Pipeline import Pipeline
from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.dataLoader.pipeline.ProbeMedia import ProbeMedia
from modules.dataLoader.pipeline.RepeatConcepts import RepeatConcepts
from modules.dataLoader.pipeline.ResizeCropVideo import ResizeCropVideo
from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.enum.WanVariant import WanVariant
from modules.util.ranks import all_gather_json, data_rank_and_size, is_main, rank_and_world
from modules.util.video_io import UnreadableMediaError

log = logging.getLogger(__name__)


@dataclass
class DataStatistics:
    per_concept: dict[str, Counter] = field(default_factory=dict)   # concept -> {"clips": n, "images": n}
    buckets: Counter = field(default_factory=Counter)                # (frames, height, width) -> items
    skipped: list[tuple[str, str]] = field(default_factory=list)     # (file, reason)
    paths: list[str] = field(default_factory=list)                   # the usable media files, in item order


class DataError(Exception):
    """The data cannot be used at all (no usable item); raised before any model loads."""


class WanBaseDataLoader:
    def __init__(self, config: TrainConfig, variant_hint: WanVariant | None = None,
                 e2v_datasets: list | None = None):
        self.config = config
        # E2V: the dataset configs (validated, overrides applied); the first one's layout applies to all
        self.e2v_datasets = e2v_datasets or []
        # e2v.as_vace_references on a VACE model: the E2V datasets' elements are each clip's VACE references (the
        # clips then train as any VACE clip; no E2V condition)
        self.elements_as_references = bool(self.e2v_datasets and variant_hint and variant_hint.is_vace
                                           and config.e2v.as_vace_references)
        self.e2v = self.e2v_datasets[0] if self.e2v_datasets and not self.elements_as_references else None
        self.scan_result = ScanResult()
        self.validation_records: list[dict] = []   # files held out for the validation loss (validation_split.py)
        self.failed: set[str] = set()   # files that probed fine but failed to decode while caching
        self.model = None
        self.device = torch.device("cpu")
        self.pipeline: Pipeline | None = None
        self.encoders: dict[str, object] = {}
        # one probe for every pipeline this loader builds (scan, caching, report, training): its results depend only
        # on the file, so each file is probed once
        self.probe = ProbeMedia()
        # every pipeline this loader builds shares one record of what was warned: each file is warned once per run
        self.warned: set = set()
        # VACE: each item carries its control, mask and references (vace_scan.py, EncodeVACE)
        self.vace = bool(variant_hint and variant_hint.is_vace)
        # Wan-Fun Control: each item carries its control (EncodeFunControl)
        self.fun_control = bool(variant_hint and variant_hint.is_fun_control)
        self.spatial_unit = variant_hint.spatial_unit if variant_hint else 16
        self.fps = variant_hint.native_fps if variant_hint else 16
        # Wan2.2-Animate: every clip comes with its companions (modules/dataLoader/animate_scan.py)
        self.animate = bool(variant_hint and variant_hint.is_animate)
        self.companion_set = companion_set(variant_hint)
        self.variant = variant_hint

    # ---- before the model -------------------------------------------------------------------------------------

    def scan(self) -> None:
        if self.animate:
            self.scan_result = scan_animate_concepts(self.config.data.concepts, self.config.animate.mode,
                                                     self.companion_set)
        elif self.elements_as_references:
            self.scan_result = ScanResult()
            for index, dataset in enumerate(self.e2v_datasets):
                concept = ConceptConfig(name=f"e2v dataset {index}", path=dataset.data_root)
                scan_e2v_dataset(dataset, concept, self.scan_result)
                elements_as_vace_references(dataset, self.scan_result.records)
        elif self.e2v is None:
            self.scan_result = scan_concepts(self.config.data.concepts)
        else:
            self.scan_result = ScanResult()
            for index, dataset in enumerate(self.e2v_datasets):
                concept = ConceptConfig(name=f"e2v dataset {index}", path=dataset.data_root)
                scan_e2v_dataset(dataset, concept, self.scan_result)
        self.scan_result.records, self.validation_records = split_validation(self.scan_result.records,
                                                                             self.config.data)
        pipeline = Pipeline(self._item_modules(), self.config.seed)
        pipeline.start_epoch(0)
        if len(pipeline) == 0:
            raise DataError(self._nothing_usable_message(pipeline))

    def companion_problems(self) -> list[str]:
        """Config problems the scan found (companion_checks.py): a concept's control or mask folder that gives no clip
        its companion, a control model whose clips have no control at all. Needs `scan()` first; no model."""
        records = self.scan_result.records + self.validation_records
        concepts = self.config.data.concepts
        takes_control = bool(self.variant and self.variant.takes_control_video)
        if self.e2v is not None:   # E2V's own items: conditioned by their elements, not by concepts' companions
            return []
        return unused_folder_problems(records, concepts, takes_control) + \
            blank_control_problems(records, concepts, self.variant, self.config.data.control.derive)

    def _nothing_usable_message(self, pipeline: Pipeline) -> str:
        concepts = [c.path for c in self.config.data.concepts if c.enabled] or ["(no enabled concept)"]
        skipped = self.scan_result.skipped + list(pipeline.skipped)
        lines = [f"no usable training item in {', '.join(concepts)}"]
        if self.validation_records:
            held_out = len({r["path"] for r in self.validation_records})
            lines.append(f"  ({held_out} files are held out for the validation loss: concepts marked validation, "
                         f"data.validation_split)")
        for concept in self.config.data.concepts:
            if concept.enabled and concept.balancing is None and concept.repeats < 1:
                lines.append(f"  concept {concept.path}: repeats {concept.repeats:g} keeps round(items x repeats) of "
                             f"its items per epoch, none when that is below 0.5 (raise repeats, or set balancing)")
        lines += [f"  skipped {path}: {reason}" for path, reason in skipped[:10]]
        if len(skipped) > 10:
            lines.append(f"  ... and {len(skipped) - 10} more")
        return "\n".join(lines)

    @property
    def has_masks(self) -> bool:
        """Some training or validation item has a loss mask (docs/masks.md): every item then carries a mask weight."""
        return any(r.get("mask") for r in self.scan_result.records + self.validation_records)

    @property
    def mask_is_loss_region(self) -> bool:
        """A clip's mask weighs its loss; a VACE control mask with `data.control.loss_region: all` only conditions."""
        return not (self.vace and self.config.data.control.loss_region == "all")

    def _records(self, validation: bool = False) -> list[dict]:
        records = self.validation_records if validation else self.scan_result.records
        return [r for r in records if r["path"] not in self.failed]

    def _item_modules(self, validation: bool = False) -> list:
        """The item modules of training, or (`validation`) of the held-out items: each once, no random crop or
        flip, the caption always kept."""
        data = self.config.data
        record_names = ["path", "concept", "caption"] + (["elements", "e2v_present"] if self.e2v else [])
        record_names += ["mask"] if self.has_masks or self.vace else []
        # the reference count is a batch key: clips with as many references batch together
        record_names += ["control", "references", "reference_count"] if self.vace else []
        record_names += ["control"] if self.fun_control else []
        record_names += ["companions"] if self.animate else []
        return [
            ListSource(self._records(validation), record_names),
            self.probe,
            FrameWindow(data.frame_buckets, self.fps, warned=self.warned,
                        condition_frames=self.config.animate.continuation_frames if self.animate else 0),
            *([] if validation else [RepeatConcepts()]),
            ResolutionBucket(data.resolution, data.aspect_ratios, unit=self.spatial_unit, no_upscale=data.no_upscale,
                             warned=self.warned),
            LoadVideo(),
            ResizeCropVideo(crop_jitter=data.crop_jitter and not validation, flip=data.flip and not validation),
            ApplyConceptSettings(),
        ]

    # ---- with the model ---------------------------------------------------------------------------------------

    def attach_model(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.spatial_unit, self.fps = model.spatial_unit, model.variant.native_fps
        self.vace = model.variant.is_vace
        self.fun_control = model.variant.is_fun_control
        # kept: the text encoder is released after caching, and a later rebuild (a resume's batch size) needs it
        self.text_identity = cache_key(model.source, model.text_encoder.config.to_dict(), len(model.tokenizer),
                                       str(model.text_encoder.dtype))
        self.rebuild()

    def encoder_modules(self) -> list:
        """The encoders for this model and method; E2V adds its element modules here."""
        model, config = self.model, self.config
        cache_root = Path(config.cache_dir)
        vae_identity = cache_key(model.source, dict(model.vae.config), str(model.vae.dtype))
        variant = model.variant
        # I2V, I2V-A14B, Wan-Fun InP: the first frame kept through the mask / masked-video channels
        condition = "first_last" if variant is WanVariant.FLF2V else "first" if variant.takes_image_condition \
            else None
        augmented = config.data.crop_jitter or config.data.flip
        if self.animate and variant.takes_driving_video:
            from modules.dataLoader.pipeline.EncodeAnimate2 import EncodeAnimate2
            identity = cache_key(vae_identity, model.source, model.image_encoder.config.to_dict())
            modules = [EncodeAnimate2(model, DiskCache(cache_root, "animate-2"), identity,
                                      config.animate.continuation_frames)]
        elif self.animate:
            identity = cache_key(vae_identity, model.source, model.image_encoder.config.to_dict(),
                                 dict(model.transformer.config))
            modules = [EncodeAnimate(model, DiskCache(cache_root, "animate"), identity, config.animate.mode,
                                     config.animate.continuation_frames)]
        elif self.e2v is not None:
            identity = cache_key(vae_identity, model.source, model.image_encoder.config.to_dict()
                                 if model.image_encoder is not None else None)
            modules = [EncodeE2V(model, DiskCache(cache_root, "e2v"), identity, self.e2v),
                       ApplyFrameConditioning(model, self.e2v)]
        else:
            modules = [EncodeVideo(model, DiskCache(cache_root, "latents"), vae_identity, condition=condition,
                               clip=model.image_encoder is not None and (condition is not None or self.fun_control),
                               augmented=augmented,
                               latent_dtype=torch.bfloat16 if config.performance.cache_latents_bf16 else torch.float32)]
        if self.vace:
            from modules.dataLoader.pipeline.EncodeVACE import EncodeVACE
            modules.append(EncodeVACE(model, DiskCache(cache_root, "vace"), vae_identity,
                                      derive=config.data.control.derive))
        if self.fun_control:
            from modules.dataLoader.pipeline.EncodeFunControl import EncodeFunControl
            modules.append(EncodeFunControl(model, DiskCache(cache_root, "fun_control"), vae_identity,
                                            derive=config.data.control.derive))
        if self.has_masks and self.e2v is None and self.mask_is_loss_region:
            modules.append(EncodeMask(DiskCache(cache_root, "masks"), model.vae_spatial_stride,
                                      model.vae_temporal_stride))
        text_identity = self.text_identity
        if config.training_method is not TrainingMethod.EMBEDDING:
            modules.append(EncodeText(model, DiskCache(cache_root, "text"), text_identity))
        if self.animate and variant.takes_driving_video:
            from modules.dataLoader.pipeline.EncodeAnimate2 import EncodeReferencePrompt
            modules.append(EncodeReferencePrompt(model, DiskCache(cache_root, "text"), text_identity))
        return modules

    def rebuild(self) -> None:
        encoders = self.encoder_modules()
        self.encoders = {type(m).__name__: m for m in encoders}
        # the per-slot condition cache is an item-level input to frame conditioning, not a batch tensor
        batch_names = [name for m in encoders for name in m.produces() if name != "e2v_condition_cache"]
        batch_names += ["loss_weight", "prompt"]
        # E2V items with different elements present carry different numbers of CLIP tokens: batch them apart
        keys = ("frame_bucket", "resolution_bucket") + (("e2v_present",) if self.e2v else ()) \
            + (("reference_count",) if self.vace else ())
        # several ranks: each data-parallel group draws its share of the single-process global batches
        # (RankBucketBatch); the ranks of one context-parallel group share theirs
        rank, world = data_rank_and_size()
        modules = self._item_modules() + encoders + [RankBucketBatch(batch_names, self.config.batch_size, rank, world,
                                                                     key_names=keys)]
        self.pipeline = Pipeline(modules, self.config.seed, threads=self.config.data.dataloader_threads)

    def encode_calls(self) -> int:
        return sum(getattr(m, "encode_calls", 0) for m in self.encoders.values())

    def _encoder_parts(self, encoder) -> list[torch.nn.Module]:
        """The model parts an encoder module runs."""
        if isinstance(encoder, EncodeText):
            return [self.model.text_encoder]
        if isinstance(encoder, (EncodeVideo, EncodeE2V, EncodeAnimate)) \
                or type(encoder).__name__ in ("EncodeVACE", "EncodeFunControl", "EncodeAnimate2"):
            return [part for part in (self.model.vae, self.model.image_encoder) if part is not None]
        return []

    def cache(self, epochs: int | None = None, after_text: Callable[[], None] | None = None) -> None:
        """Encodes every item of the first epoch (and of each of `epochs` epochs, default `config.epochs`, when
        windows or crops are random) into the disk cache, one encoder at a time: the text encoder pass, then the
        VAE (with CLIP) pass, each part on the training device only for its pass, so a 24 GB card never holds UMT5
        and the VAE together, nor either with the transformer (which moves there after caching). `after_text` runs
        between the two (the trainer releases the text encoder there: UMT5-XXL's 10.6 GiB are not in host memory
        while the VAE pass decodes clips). Items whose media fail to decode are skipped, counted and left out of
        training."""
        epochs = range(epochs or self.config.epochs) if self._varies_per_epoch() else range(1)
        if self.config.performance.vae_tiling:
            self.model.vae.enable_tiling()
        # each pass writes its own entries, computed from the item alone: the order changes no entry
        texts = [encoder for encoder in self.encoders.values() if isinstance(encoder, EncodeText)]
        for encoder in texts + [encoder for encoder in self.encoders.values() if encoder not in texts]:
            if after_text is not None and not isinstance(encoder, EncodeText):
                after_text()
                after_text = None
            parts = self._encoder_parts(encoder)
            if not parts and not isinstance(encoder, EncodeMask):
                continue
            for part in parts:
                part.to(self.device)
            try:
                for epoch in epochs:
                    self._cache_epoch(epoch, encoder)
                if self.validation_records:
                    self._cache_epoch(0, encoder, validation=True)
            finally:
                for part in parts:
                    part.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        if after_text is not None:   # no pass after the text pass
            after_text()
        self.report()

    def _varies_per_epoch(self) -> bool:
        data = self.config.data
        return data.crop_jitter or data.flip or any(c.extraction == "random" for c in data.concepts)

    def _cache_epoch(self, epoch: int, encoder, validation: bool = False) -> None:
        """Fills the cache of one encoder module for one epoch (the pipeline computes only what it outputs).
        Several ranks split the work by what an entry depends on: text entries by prompt, the others by media
        file, so each entry has one owner and nothing is encoded twice (one rank alone does it all)."""
        items = Pipeline(self._item_modules(validation) + list(self.encoders.values()), self.config.seed,
                         threads=self.config.data.dataloader_threads, outputs=list(encoder.produces()))
        items.start_epoch(epoch)
        share = self._rank_share(epoch, "prompt" if isinstance(encoder, EncodeText) else "path", len(items),
                                 validation)
        newly_failed: dict[str, str] = {}
        for index in tqdm(share, desc=f"caching {type(encoder).__name__} "
                          f"{'validation items' if validation else f'epoch {epoch}'}", unit="item",
                          disable=not is_main()):
            try:
                items.get_item(index)
            except UnreadableMediaError as error:
                log.warning("skipping %s: %s", error.path, error.reason)
                newly_failed[str(error.path)] = error.reason
        # the gather waits for every rank's share: after it each rank reads the entries the others wrote, and
        # knows what they could not decode
        for rank_failed in all_gather_json(newly_failed):
            newly_failed.update(rank_failed)
        self.scan_result.skipped.extend(newly_failed.items())
        if newly_failed:
            self.failed |= set(newly_failed)
            if not self._records():
                raise DataError(f"no usable training item: every file failed to decode ({len(self.failed)})")
            self.rebuild()

    def _rank_share(self, epoch: int, group: str, count: int, validation: bool = False) -> list[int]:
        """The item indices of `epoch` this rank encodes: the distinct values of `group` (path or prompt) are
        dealt out in order, and every item with a value goes to that value's rank (repeats, windows of one clip and
        clips of one caption share entries)."""
        rank, world = rank_and_world()
        if world == 1:
            return list(range(count))
        values = Pipeline(self._item_modules(validation), self.config.seed, outputs=[group])
        values.start_epoch(epoch)
        owner: dict[str, int] = {}
        share = []
        for index in range(len(values)):
            value = str(values.get_item(index)[group])
            owner.setdefault(value, len(owner) % world)
            if owner[value] == rank:
                share.append(index)
        return share

    def statistics(self) -> DataStatistics:
        """Per concept the clip and image items, the bucket histogram and the skipped files (probe-level names
        only: nothing is decoded). Needs `scan()` first; no model."""
        names = ["frame_bucket", "resolution_bucket", "concept", "path"]
        items = Pipeline(self._item_modules(), self.config.seed, outputs=names)
        items.start_epoch(0)
        stats = DataStatistics()
        for index in range(len(items)):
            row = items.get_item(index)
            height, width = row["resolution_bucket"]
            stats.buckets[(row["frame_bucket"], height, width)] += 1
            kind = "images" if row["frame_bucket"] == 1 else "clips"
            stats.per_concept.setdefault(row["concept"].name or row["concept"].path, Counter())[kind] += 1
            if row["path"] not in stats.paths:
                stats.paths.append(row["path"])
        stats.skipped = self.scan_result.skipped + list(items.skipped)
        return stats

    def report(self) -> str:
        stats = self.statistics()
        lines = ["data (buckets: frames x width x height, as the plan writes them):"]
        for concept, counts in stats.per_concept.items():
            lines.append(f"  concept {concept}: {counts['clips']} clip items, {counts['images']} image items")
        for (frames, height, width), count in sorted(stats.buckets.items()):
            lines.append(f"  bucket {frames} frames x {width}x{height}: {count}")
        if self.has_masks:
            records = self._records() + self._records(validation=True)
            masked = len({r["path"] for r in records if r.get("mask")})
            what = "loss masks" if self.mask_is_loss_region else "control masks (data.control.loss_region all: no loss weight)"
            lines.append(f"  {what}: {masked} of {len({r['path'] for r in records})} files (docs/masks.md)")
        controls = control_report_line(self._records() + self._records(validation=True), self.variant,
                                       self.config.data.control.derive)
        if controls:
            lines.append(controls)
        if self.validation_records:
            files = len({r["path"] for r in self._records(validation=True)})
            lines.append(f"  validation: {files} held-out files (never trained on)")
        lines.append(f"  skipped files: {len(stats.skipped)}")
        text = "\n".join(lines)
        if is_main():
            print(text, flush=True)
        return text

    def target_latents_by_path(self) -> dict[str, torch.Tensor]:
        """The cached training-target latents (raw) of every item of epoch 0, by media path."""
        items = Pipeline(self._item_modules() + list(self.encoders.values()), self.config.seed,
                         outputs=["path", "latents"])
        items.start_epoch(0)
        return {row["path"]: row["latents"] for row in (items.get_item(i) for i in range(len(items)))}

    def validation_pipeline(self, batch_size: int) -> Pipeline:
        """The held-out items in batches of one bucket each, cut in the same order on every run and world size
        (no shuffle); its last module's `upstream_indices(i)` are the items of batch i. Reads the same caches as
        training (the items were cached with it). The batches hold what training batches hold but the loss weight."""
        training = self.pipeline.modules[-1]  # the training batcher (rebuild): its names and bucket keys
        names = [name for name in training.names if name != "loss_weight"]
        modules = self._item_modules(validation=True) + list(self.encoders.values()) + [
            BucketBatch(names, batch_size, shuffle=False, key_names=training.key_names)]
        pipeline = Pipeline(modules, self.config.seed, threads=self.config.data.dataloader_threads)
        pipeline.start_epoch(0)
        return pipeline

    # ---- batches ----------------------------------------------------------------------------------------------

    def batches_per_epoch(self, epoch: int = 0) -> int:
        self.pipeline.start_epoch(epoch)
        return len(self.pipeline)

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict]:
        probability = self.config.data.ti2v_image_probability
        pin = self.device.type == "cuda"
        for number, batch in enumerate(self.pipeline.iterate(epoch, start_batch), start=start_batch):
            batch["loss_weight"] = torch.tensor(batch["loss_weight"], dtype=torch.float32)
            if pin:
                # page-locked batches let the training step copy them with non_blocking=True
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            if self.model is not None and self.model.expand_timesteps and probability > 0:
                draw = derive_seed(self.config.seed, epoch, number, "ti2v_image_mode") / 2 ** 64
                batch["clean_first_frame"] = draw < probability
            yield batch

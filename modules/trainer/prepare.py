"""Everything that must hold before a model loads, checked in one pass: the config's paths, device, model variant,
E2V datasets and samples file. Every problem found is reported in one ConfigError (the CLI exits 2), so a user fixes
them all at once and no weights are read for a config that cannot run."""
import json
import logging
from pathlib import Path

from modules.util.config.ConfigError import ConfigError
from modules.util.config.TrainConfig import TrainConfig
from modules.util.config.validation import check_paths
from modules.util.devices import resolve_device

log = logging.getLogger(__name__)


def prepare_config(config: TrainConfig) -> list:
    """Everything that must hold before a model loads: demo assets created when asked, paths exist, the model is
    the configured type, the E2V datasets are valid (returned, resolved, for the trainer). Every problem found is
    reported in one ConfigError."""
    demo_notes: list[str] = []
    if config.demo_assets:
        from modules.util.demo_assets import ensure_demo_assets
        try:
            demo_notes = ensure_demo_assets(config)
        except OSError as error:
            raise ConfigError([f"demo_assets: the demo model or dataset cannot be created at the configured paths "
                               f"({error})"]) from None
    from modules.util.config.output_destination import add_missing_extension
    add_missing_extension(config)
    problems: list[str] = fp8_problems(config)
    try:
        check_paths(config)
    except ConfigError as error:
        problems += error.problems
    from modules.util.config.performance_checks import performance_problems
    problems += performance_problems(config, resolve_device(config.device))
    base = Path(config.model.base_model_name)
    spatial_unit, variant = 16, None
    from modules.util.config.validation import model_path_problems
    # an empty name (Path ".") is reported once, as empty; a part path that is no file or folder, once, as such
    if config.model.base_model_name and base.is_dir() and not model_path_problems(config):
        # the model's files are read by content (keys and shapes only), whatever their layout
        from modules.modelLoader.wan.parts.model_plan import detect_model_variant, plan_problems
        from modules.util.wan_detection import NotAWanModelError
        try:
            variant = detect_model_variant(config.model)
            spatial_unit = variant.spatial_unit
            if variant.model_type is not config.model_type:
                problems.append(f"model_type: {config.model_type} is set, but {str(base)!r} is a {variant} model "
                                f"({variant.model_type})")
        except NotAWanModelError as error:
            problems.append(str(error) if str(error).startswith("model.") else f"model.base_model_name: {error}")
            variant = None
        if variant is not None:
            problems += plan_problems(config.model, config.training_method.value == "FINE_TUNE",
                                      dora=config.training_method.value == "LORA" and config.lora.dora)
            try:
                check_model_variant(config, variant, str(base))
            except ConfigError as error:
                problems += error.problems
            problems += expert_problems(config, variant, base)
            note_inapplicable_control(config, variant, base)
            note_inapplicable_distill(config)
            if variant.is_animate and not variant.takes_replacement and config.animate.mode == "replace":
                problems.append(f"animate.mode: replace puts the character into the driving video's scene, which "
                                f"Wan2.2-Animate-14B does; {str(base)!r} is {variant}, which animates only: set "
                                f"animate.mode=animate")
            if variant.is_animate:
                problems += continuation_problems(config)
            if variant.is_animate and config.e2v.enabled:
                problems.append("e2v: Elements-to-Video trains T2V / I2V models, not Wan2.2-Animate")
    if not config.e2v.enabled and not any(concept.enabled for concept in config.data.concepts):
        # found here, not after the data scan as "no usable training item in (no enabled concept)"
        problems.append("data.concepts: no enabled concept: add your dataset folder as a concept (the window's "
                        "concepts tab, or --config-value 'data.concepts=[{\"path\": \"DIR\"}]')")
    training = [index for index, concept in enumerate(config.data.concepts)
                if concept.enabled and not concept.validation]
    if not config.e2v.enabled and training and all(config.data.concepts[i].loss_weight == 0 for i in training):
        problems.append(f"data.concepts.{training[0]}.loss_weight: every training concept has loss_weight 0: no item "
                        f"would carry loss and the run would train nothing; give a concept a loss_weight above 0")
    datasets = []
    if config.e2v.enabled:
        from modules.util.config.E2VConfig import check_against_frames
        from modules.util.config.e2v_setup import apply_e2v_data_settings, resolve_e2v_datasets
        try:
            datasets = resolve_e2v_datasets(config, spatial_unit)
            from modules.util.config.image_encoder_source import resolve_image_encoder
            as_references = config.e2v.as_vace_references and variant is not None and variant.is_vace
            if config.e2v.as_vace_references and variant is not None and not variant.is_vace:
                problems.append(f"e2v.as_vace_references: the elements become VACE reference images, but "
                                f"{str(base)!r} is a {variant} model, not VACE")
            if not as_references:   # a VACE model reads the elements through its VAE alone, as references before
                # the clip's latent frames (not in its frames): the E2V frame layout does not apply
                problems += resolve_image_encoder(config, datasets[0].uses_clip, datasets[0].e2v_type)
                apply_e2v_data_settings(config, datasets[0])
            for index, dataset in enumerate(datasets if not as_references else []):
                try:
                    check_against_frames(dataset, min(config.data.frame_buckets), f"e2v datasets.{index}.")
                except ConfigError as error:
                    problems += error.problems
        except ConfigError as error:
            problems += error.problems
    if config.sampling.samples_file and Path(config.sampling.samples_file).is_file():
        from modules.util.sample_definitions import SampleDefinitionError, load_sample_definitions
        try:
            load_sample_definitions(config.sampling.samples_file)
        except SampleDefinitionError as error:
            problems.append(f"sampling.samples_file: {error}")
    if problems:
        # the note says why a demo path is missing, only when one is
        demo_fields = ("model.base_model_name", "data.concepts", "sampling.samples_file")
        raise ConfigError(problems + (demo_notes if any(p.startswith(demo_fields) for p in problems) else []))
    return datasets


def check_model_variant(config: TrainConfig, variant, source: str) -> None:
    """Refuses a model of another variant than the config (preset) is made for, and a `lora.init_from` file made
    for another variant, naming both (ConfigError)."""
    from modules.util.modelspec import architecture, describe_architecture, lora_model_mismatch
    intended = config.model.intended_variant
    if intended is not None and intended is not variant:
        from modules.util.presets import presets_for_variant
        fitting = presets_for_variant(variant)
        advice = f"use a preset made for {variant} ({', '.join(fitting)})" if fitting else \
            f"use a config made for {variant}"
        raise ConfigError([f"model.intended_variant: the config (preset) is made for {intended} models, "
                           f"{describe_architecture(architecture(intended))}, but {source!r} is a {variant} model, "
                           f"{describe_architecture(architecture(variant))}: it would train a {variant} LoRA with "
                           f"settings meant for {intended}. {advice[0].upper() + advice[1:]}, or set "
                           f"model.intended_variant={variant.value} if this is what you want"])
    if config.lora.init_from and config.training_method.value == "LORA" and not config.e2v.enabled:
        mismatch = lora_model_mismatch(config.lora.init_from, variant)
        if mismatch:
            raise ConfigError([f"lora.init_from: {mismatch}"])


def note_inapplicable_control(config: TrainConfig, variant, base: Path) -> None:
    """Control settings on a model that takes no control video are ignored: said, as `expert` is."""
    if variant.takes_control_video:
        return
    if config.data.control.derive != "none":
        log.warning("data.control.derive=%s is set, but %s is a %s model, which takes no control video: derived "
                    "controls apply to control models (VACE, Wan-Fun Control) only and are ignored",
                    config.data.control.derive, base, variant)
    for index, concept in enumerate(config.data.concepts):
        if concept.enabled and concept.control_path:
            log.warning("data.concepts.%d.control_path is set, but %s is a %s model, which takes no control video: "
                        "it is ignored", index, base, variant)


def note_inapplicable_distill(config: TrainConfig) -> None:
    """distill settings that the run's mode or sampling do not use are ignored: said, as control settings are."""
    distill, defaults = config.distill, type(config.distill)()
    if distill.mode == "base" and (distill.preserve_weight != defaults.preserve_weight
                                   or distill.preserve_on != defaults.preserve_on):
        log.warning("distill.preserve_weight / distill.preserve_on are set, but distill.mode is base: they apply to "
                    "distill.mode=preserve only and are ignored")
    if distill.stack_check != defaults.stack_check and not config.sampling.accelerator.enabled:
        log.warning("distill.stack_check is set, but sampling.accelerator has no file: the stack check compares "
                    "accelerated previews with full-step ones, so it is ignored")


def expert_problems(config: TrainConfig, variant, base: Path) -> list[str]:
    """`expert` is for Wan 2.2 A14B (noted, not refused, elsewhere); there, the expert's side of the boundary must
    meet [min_sigma, max_sigma], or the first step finds no sigma to draw."""
    if not variant.has_two_experts:
        if config.expert != "both":
            log.warning("expert=%s is set, but %s is a %s model with one transformer: expert applies to Wan 2.2 "
                        "A14B only and is ignored", config.expert, base, variant)
        return []
    index = base / "model_index.json"
    boundary = json.loads(index.read_text(encoding="utf-8")).get("boundary_ratio") if index.is_file() else None
    if boundary is None or config.expert == "both":
        return []
    low, high = (boundary, 1.0) if config.expert == "high" else (0.0, boundary)
    timestep = config.timestep
    if max(low, timestep.min_sigma) >= min(high, timestep.max_sigma):
        return [f"timestep.min_sigma / max_sigma: [{timestep.min_sigma:g}, {timestep.max_sigma:g}] has no sigma in "
                f"the {config.expert}-noise expert's range [{low:g}, {high:g}] (boundary {boundary:g}): widen it, "
                f"or train the other expert"]
    return []


def continuation_problems(config: TrainConfig) -> list[str]:
    """Animate, Animate-2: `animate.continuation_frames` k leaves the latent frames of the clip's first k frames out
    of the loss, so a clip cut at k frames or fewer carries no loss at all (a run of zero losses that saves a LoRA
    as if trained). A concept whose every frame count is that short is refused; in a concept with longer counts too,
    the clips cut that short are skipped and counted (FrameWindow)."""
    carry = config.animate.continuation_frames
    found: dict[str, str] = {}
    for index, concept in enumerate(config.data.concepts):
        if not carry or not concept.enabled or concept.extraction == "full":
            continue
        if concept.target_frames:
            field, counts = f"data.concepts.{index}.target_frames", concept.target_frames
        elif concept.frame_buckets:
            field, counts = f"data.concepts.{index}.frame_buckets", concept.frame_buckets
        else:
            field, counts = "data.frame_buckets", config.data.frame_buckets
        if max(counts) > carry and concept.max_frames > carry:
            continue
        what = f"{field} {counts}" if max(counts) <= carry else f"data.concepts.{index}.max_frames {concept.max_frames}"
        found.setdefault(what, f"animate.continuation_frames: {carry} frames condition each clip and carry no loss, "
                               f"but {what} cuts no clip longer than {carry} frames: no frame would carry loss and the "
                               f"run would train nothing; give a frame count of {carry + 4} or more, or set "
                               f"animate.continuation_frames=0")
    return list(found.values())


def fp8_problems(config: TrainConfig) -> list[str]:
    """FLOAT_8 base weights are stored in float8 and computed in bfloat16: the rest of the step must be bfloat16 too
    (found here, not as a dtype mismatch in the first forward)."""
    parts = [part for part in ("transformer", "transformer_2") if getattr(config.model, part).weight_dtype.value
             == "FLOAT_8"]
    if parts and config.train_dtype.value != "BFLOAT_16":
        return [f"model.{parts[0]}.weight_dtype: FLOAT_8 weights are computed in bfloat16, but train_dtype is "
                f"{config.train_dtype.value}: set train_dtype=BFLOAT_16, or keep the weights in "
                f"{config.train_dtype.value}"]
    return []

"""E2V dataset configuration: the user's three JSON forms (seeds 000, 001, 002, kept verbatim in tests/fixtures/), validation errors
that name the field, alignment warnings and caption prefix stripping."""
import json
import logging

import pytest
from pydantic import ValidationError

from modules.util.config.config_io import ConfigError
from modules.util.config.E2VConfig import (ClipProcessorConfig, E2VDatasetConfig, E2VElementVaeConfig,
                                           VaeProcessorConfig, aligned_repeats, check_against_frames,
                                           load_e2v_dataset_configs, min_clip_frames, round_to_spatial_unit,
                                           strip_llm_caption_prefix)
from seed_configs import fixture_text, user_seed_text

SEED_000 = fixture_text("000")   # seeds/000 (E2V implementation guide, section 2.1), verbatim

SEED_001 = fixture_text("001")   # seeds/001 (E2V user documentation), verbatim

SEED_002 = fixture_text("002")   # seeds/002 (A2 training goals: the flat form), verbatim


def load(text: str) -> list[E2VDatasetConfig]:
    return load_e2v_dataset_configs(json.loads(text))


def problems_of(source) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_e2v_dataset_configs(source)
    return info.value.problems


def one_problem(source, field: str) -> str:
    """The single problem, which must name `field` as its dotted path."""
    problems = problems_of(source)
    assert len(problems) == 1, problems
    assert problems[0].startswith(field + ": "), problems
    return problems[0]


def edited(text: str, edit) -> dict:
    data = json.loads(text)
    edit(data["datasets"][0])
    return data


# --- the three seed forms ---------------------------------------------------------------------------------------

def test_seed_000_nested_form(tmp_path):
    path = tmp_path / "e2v.json"
    path.write_text(SEED_000)
    [config] = load_e2v_dataset_configs(path)
    assert config == load(SEED_000)[0]
    assert config.data_root == "path/to/e2v/dataset" and config.dataset_type == "e2v"
    assert config.target_resolution == (480, 854) and config.reshape_mode == "bicubic"
    assert config.remove_common_llm_caption_prefixes and config.auto_frame_buckets
    subject, secondary = config.elements
    assert subject.name == "main_subject" and subject.required and subject.suffixes[0] == "_dog.png"
    assert subject.vae == E2VElementVaeConfig(repeat=4, position=0)
    assert subject.clip.preprocess == "center_crop" and secondary.clip.preprocess == "pad_white"
    assert not secondary.required and secondary.vae.position == 1
    vae, clip = config.processors.vae, config.processors.clip
    assert vae == VaeProcessorConfig(resolution=(480, 854), combine="before", default_preprocess="resize",
                                     frame_conditioning="full", frame_index=0, concatenate_mask=True)
    assert clip == ClipProcessorConfig(resolution=(512, 512), default_preprocess="center_crop")
    vis = config.visualization
    assert vis.enabled and vis.frequency == 100 and vis.resolved_output_dir("run7") == "visualizations/run7"
    assert [(p.type, p.data, p.frames, p.format) for p in vis.processors] == [
        ("latent_save", ["input_latents", "predicted_latents"], None, "safetensors"),
        ("vae_decode", ["input_latents", "predicted_latents"], [0, -1], "png")]
    # derived values
    assert config.repeats() == [4, 4] and config.num_reference_frames == 8 and not config.repeats_aligned
    assert config.vae_preprocess(subject) == "resize" and config.clip_preprocess(secondary) == "pad_white"
    assert config.condition_channels() == 20 and config.uses_vae and config.uses_clip


def test_seed_001_three_elements():
    [config] = load(SEED_001)
    assert [e.name for e in config.elements] == ["main_subject", "secondary", "environment"]
    assert config.repeats() == [4, 4, 4]
    assert [e.clip.preprocess for e in config.elements] == ["center_crop", "pad_white", "letterbox"]
    assert not config.remove_common_llm_caption_prefixes and not config.visualization.enabled


def test_seed_002_flat_form_maps_onto_the_nested_one():
    [flat] = load(SEED_002)
    assert flat.repeats() == [1, 4, 4] and flat.repeats_aligned
    assert flat.processors.clip.resolution == (512, 512) and flat.processors.vae.combine == "before"
    # no processors.vae.resolution in the flat form: the target resolution
    assert flat.processors.vae.resolution == flat.target_resolution == (480, 704)
    assert [(p.type, p.format) for p in flat.visualization.processors] == [("latent_save", "pt"),
                                                                            ("vae_decode", "png")]

    def aligned(dataset):
        for element, repeat in zip(dataset["elements"], (1, 4, 4)):
            element["vae"]["repeat"] = repeat
    [nested] = load_e2v_dataset_configs(edited(SEED_001, aligned))
    # 002 does not say `required`; everything else about the elements is said the same way in both
    assert [e.model_dump(exclude={"required"}) for e in flat.elements] == \
           [e.model_dump(exclude={"required"}) for e in nested.elements]
    assert flat.processors.clip == nested.processors.clip
    assert flat.processors.vae.model_dump(exclude={"resolution"}) == \
           nested.processors.vae.model_dump(exclude={"resolution"})


def test_a_dataset_without_the_wrapper_and_a_list_of_datasets():
    [wrapped] = load(SEED_000)
    assert load_e2v_dataset_configs(json.loads(SEED_000)["datasets"][0]) == [wrapped]
    assert load_e2v_dataset_configs(json.loads(SEED_000)["datasets"] * 2) == [wrapped, wrapped]


def test_the_flat_form_with_clip_disabled_and_a_nested_round_trip():
    def no_clip(dataset):
        dataset["elements"][2]["clip_process"] = False
    [config] = load_e2v_dataset_configs(edited(SEED_002, no_clip))
    assert config.elements[2].clip is None and config.clip_preprocess(config.elements[2]) is None
    dumped = config.model_dump(mode="json")
    assert dumped["elements"][2]["clip"] is False          # written back in the user's spelling
    assert load_e2v_dataset_configs(dumped) == [config]


def test_unaligned_repeats_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="modules.util.config.E2VConfig"):
        load(SEED_001)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "4, 4, 4" in warnings[0].getMessage() and "1, 4, 4" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="modules.util.config.E2VConfig"):
        load(SEED_002)
    assert not caplog.records
    assert aligned_repeats(3) == [1, 4, 4] and aligned_repeats(1) == [1]


# --- invalid configs: one ConfigError problem naming the field -------------------------------------------------

def test_no_elements():
    one_problem(edited(SEED_001, lambda d: d.update(elements=[])), "datasets.0.elements")
    one_problem(edited(SEED_001, lambda d: d.pop("elements")), "datasets.0.elements")


def test_duplicate_positions_and_names():
    def same_position(dataset):
        dataset["elements"][1]["vae"]["position"] = 0
    assert "main_subject" in one_problem(edited(SEED_001, same_position), "datasets.0.elements.1.vae.position")

    def flat_same_position(dataset):
        dataset["elements"][2]["position"] = 1
    one_problem(edited(SEED_002, flat_same_position), "datasets.0.elements.2.position")

    def gap(dataset):
        dataset["elements"][2]["vae"]["position"] = 5
    one_problem(edited(SEED_001, gap), "datasets.0.elements.2.vae.position")

    def same_name(dataset):
        dataset["elements"][2]["name"] = "secondary"
    one_problem(edited(SEED_001, same_name), "datasets.0.elements.2.name")


def test_unknown_preprocess_modes():
    def clip_mode(dataset):
        dataset["elements"][1]["clip"]["preprocess"] = "zoom"
    assert "'zoom'" in one_problem(edited(SEED_001, clip_mode), "datasets.0.elements.1.clip.preprocess")

    def vae_mode(dataset):
        dataset["elements"][0]["vae"]["preprocess"] = "stretch"
    one_problem(edited(SEED_001, vae_mode), "datasets.0.elements.0.vae.preprocess")

    def default_mode(dataset):
        dataset["processors"]["vae"]["default_preprocess"] = "fill"
    one_problem(edited(SEED_000, default_mode), "datasets.0.processors.vae.default_preprocess")

    def flat_mode(dataset):
        dataset["elements"][2]["clip_process"] = "fill"
    one_problem(edited(SEED_002, flat_mode), "datasets.0.elements.2.clip_process")

    def reshape(dataset):
        dataset["reshape_mode"] = "lanczos"
    one_problem(edited(SEED_000, reshape), "datasets.0.reshape_mode")


def test_unknown_conditioning_and_combine():
    def conditioning(dataset):
        dataset["processors"]["vae"]["frame_conditioning"] = "last"
    one_problem(edited(SEED_001, conditioning), "datasets.0.processors.vae.frame_conditioning")

    def combine(dataset):
        dataset["vae_combine"] = "during"
    one_problem(edited(SEED_002, combine), "datasets.0.vae_combine")

    def index_out_of_range(dataset):
        dataset["processors"]["vae"].update(frame_conditioning="index", frame_index=3)
    one_problem(edited(SEED_001, index_out_of_range), "datasets.0.processors.vae.frame_index")


def test_repeat_below_one():
    def nested(dataset):
        dataset["elements"][0]["vae"]["repeat"] = 0
    one_problem(edited(SEED_001, nested), "datasets.0.elements.0.vae.repeat")

    def flat(dataset):
        dataset["elements"][1]["vae_repeat"] = -1
    one_problem(edited(SEED_002, flat), "datasets.0.elements.1.vae_repeat")


def test_unknown_keys_and_mixed_spellings():
    def typo(dataset):
        dataset["elements"][0]["vae"]["repeats"] = 2
    assert "unknown key" in one_problem(edited(SEED_001, typo), "datasets.0.elements.0.vae.repeats")

    def both(dataset):
        dataset["elements"][0]["vae"] = {"repeat": 1, "position": 0}
    one_problem(edited(SEED_002, both), "datasets.0.elements.0")

    problems = problems_of({"datasets": json.loads(SEED_000)["datasets"], "extra": 1})
    assert problems == ["extra: unknown key next to datasets"]


def test_visualization_names_and_formats():
    def data_name(dataset):
        dataset["visualization"]["processors"][0]["data"] = ["input_latents", "decoded_latents"]
    one_problem(edited(SEED_000, data_name), "datasets.0.visualization.processors.0.data.1")

    def png_latents(dataset):
        dataset["visualization"]["processors"][0]["format"] = "png"
    one_problem(edited(SEED_002, png_latents), "datasets.0.visualization.processors.0")

    def pt_images(dataset):
        dataset["visualization"]["processors"][1]["format"] = "pt"
    one_problem(edited(SEED_002, pt_images), "datasets.0.visualization.processors.1")

    def placeholder(dataset):
        dataset["visualization"]["output_dir"] = "vis/{run}"
    one_problem(edited(SEED_000, placeholder), "datasets.0.visualization.output_dir")


def test_every_problem_is_reported_at_once():
    def many(dataset):
        dataset["elements"][0]["vae"]["repeat"] = 0
        dataset["processors"]["vae"]["frame_conditioning"] = "last"
    fields = [p.split(":")[0] for p in problems_of(edited(SEED_001, many))]
    assert fields == ["datasets.0.elements.0.vae.repeat", "datasets.0.processors.vae.frame_conditioning"]


def test_direct_construction_checks_too():
    data = json.loads(SEED_001)["datasets"][0]
    data["elements"][1]["vae"]["position"] = 0
    with pytest.raises(ValidationError, match="elements.1.vae.position"):
        E2VDatasetConfig.model_validate(data)


def test_check_against_frames():
    [config] = load(SEED_001)                      # 4 + 4 + 4 = 12 reference frames
    check_against_frames(config, 17)
    with pytest.raises(ConfigError) as info:
        check_against_frames(config, 9, prefix="datasets.0.")
    [problem] = info.value.problems
    assert problem.startswith("datasets.0.elements.2.vae.repeat: ") and "12" in problem and " 9 " in problem
    with pytest.raises(ConfigError, match="num_frames"):
        check_against_frames(config, 16)
    [aligned] = load(SEED_002)                     # 1 + 4 + 4 = 9
    check_against_frames(aligned, 9)

    def after_with_single_frames(dataset):
        dataset["vae_combine"] = "after"
        for element in dataset["elements"]:
            element["vae_repeat"] = 1
    [after] = load_e2v_dataset_configs(edited(SEED_002, after_with_single_frames))
    check_against_frames(after, 9)                 # 3 latent frames for 3 slots
    with pytest.raises(ConfigError) as info:       # 5 frames: 2 latent frames for 3 slots
        check_against_frames(after, 5)
    assert [p.split(":")[0] for p in info.value.problems] == ["elements.2.vae.position"]


@pytest.mark.parametrize("number", ["000", "001", "002"])
def test_the_fixtures_are_the_users_json_as_written(number):
    """tests/fixtures/ hold the seeds' JSON forms so that a clone without ../shared tests them; beside the user's
    notes they must be the same text."""
    assert fixture_text(number) == user_seed_text(number)


def test_resolutions_are_rounded_to_the_spatial_unit_with_one_notice_per_field():
    [config] = load(SEED_000)                      # 480 x 854 (16:9 of 480): 854 is no multiple of 16
    rounded, notices = round_to_spatial_unit(config, 16, "datasets.0.")
    assert rounded.target_resolution == (480, 848) and rounded.processors.vae.resolution == (480, 848)
    assert notices == ["datasets.0.target_resolution: [480, 854] is not a multiple of the model's spatial unit (16); "
                       "using [480, 848]",
                       "datasets.0.processors.vae.resolution: [480, 854] is not a multiple of the model's spatial "
                       "unit (16); using [480, 848]"]
    [flat] = load(SEED_002)                        # 480 x 704: already multiples of 16 and 32
    assert round_to_spatial_unit(flat, 16) == (flat, [])
    assert round_to_spatial_unit(flat, 32) == (flat, [])
    assert round_to_spatial_unit(flat, 64)[0].target_resolution == (512, 704)
    [tiny] = load_e2v_dataset_configs(edited(SEED_002, lambda d: d.update(target_resolution=[8, 8])))
    assert round_to_spatial_unit(tiny, 16)[0].target_resolution == (16, 16)   # never below one unit


@pytest.mark.parametrize("resolution", [[0, 480], [-480, 854], [480], [480, 854, 3], "480x854", [480.5, 854]])
def test_a_resolution_that_cannot_be_meant_is_rejected(resolution):
    [problem] = problems_of(edited(SEED_001, lambda d: d.update(target_resolution=resolution)))
    assert problem.startswith("datasets.0.target_resolution"), problem


def test_frame_buckets_too_short_for_the_references_are_no_candidates(tmp_path):
    from modules.util.config.config_io import load_config
    from modules.util.config.e2v_setup import apply_e2v_data_settings, e2v_frame_buckets
    [seed_001] = load(SEED_001)                    # 4 + 4 + 4 = 12 references, prepended: 13 frames at least
    assert min_clip_frames(seed_001) == 13
    assert e2v_frame_buckets(seed_001, [1, 17, 33, 49, 81]) == list(range(13, 82, 4))
    config = load_config()                         # the default buckets start at 1 (images)
    apply_e2v_data_settings(config, seed_001)
    assert config.data.frame_buckets == list(range(13, 82, 4))
    check_against_frames(seed_001, min(config.data.frame_buckets))
    [aligned] = load(SEED_002)                     # 1 + 4 + 4 = 9 references and one clip frame: 13
    assert min_clip_frames(aligned) == 13
    overlay = E2VDatasetConfig.model_validate(aligned.model_dump() | {"reference_frames": "overlay"})
    assert min_clip_frames(overlay) == 9
    fixed = E2VDatasetConfig.model_validate(seed_001.model_dump() | {"auto_frame_buckets": False})
    assert e2v_frame_buckets(fixed, [1, 17, 33]) == [33]
    config = load_config(overrides=["data.frame_buckets=[1, 5, 9]"])
    with pytest.raises(ConfigError, match="shortest usable bucket is 13"):
        apply_e2v_data_settings(config, seed_001)


# --- captions ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("caption, expected", [
    ("The video shows a red square moving left.", "A red square moving left."),
    ("In this video, a dog runs across the field", "A dog runs across the field"),
    ("this video depicts two cats", "Two cats"),
    ("The video features a woman in a red coat", "A woman in a red coat"),
    ("THE VIDEO CAPTURES the sunset over the sea", "The sunset over the sea"),
    ("In the video, the camera pans right", "The camera pans right"),
    ("The video shows that the ball bounces", "The ball bounces"),
    ("  The clip shows: a boat", "A boat"),
    ("A red square moving left.", "A red square moving left."),
    ("The videogame screen flickers", "The videogame screen flickers"),
    ("The video shows thatched roofs", "Thatched roofs"),
    ("The video shows", "The video shows"),
])
def test_strip_llm_caption_prefix(caption, expected):
    assert strip_llm_caption_prefix(caption) == expected


def test_auto_frame_buckets_and_target_resolution_set_the_data_buckets(tmp_path):
    from modules.util.config.config_io import load_config
    from modules.util.config.e2v_setup import apply_e2v_data_settings
    from modules.util.demo_e2v import demo_e2v_config
    raw = demo_e2v_config(tmp_path)["datasets"][0] | {"target_resolution": [480, 832]}
    for auto, expected in ((True, list(range(13, 50, 4))), (False, [49])):
        config = load_config(overrides=["data.frame_buckets=[17, 33, 49]"])
        apply_e2v_data_settings(config, load_e2v_dataset_configs({**raw, "auto_frame_buckets": auto})[0])
        assert config.data.frame_buckets == expected
        assert round(config.data.resolution ** 2 / config.data.aspect_ratios[0]) ** 0.5 == pytest.approx(480, abs=1)

"""Issue 16's property: every config document either loads or fails with ConfigError (the scripts' exit 2), never
another exception, never minutes of work or gigabytes of memory first. "Loads" is what scripts/train.py runs before
any model loads: load_config + prepare_config.

Documents come from three sources: the whole TrainConfig JSON schema (sparse documents with right and wrong types,
edge and huge numbers, NaN, unicode, nesting, old-version keys), mutations of every shipped preset, and both E2V JSON
forms (the nested form of seed 001 and the flat form of seed 002, tests/fixtures/e2v_*.json), inline and as files;
each with random --config-value overrides. Paths come from a pool of real and broken ones in a scratch folder.

CONFIG_FUZZ_EXAMPLES sets the examples per source (CI: 100 each, about half a minute); docs/reliability.md has the
figures of a longer run.
"""
import copy
import json
import os
import resource
from collections import Counter
import shutil
import time
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.dataLoader.pipeline.RepeatConcepts import RepeatConcepts
from modules.dataLoader.pipeline.ResolutionBucket import ResolutionBucket
from modules.trainer.prepare import prepare_config
from modules.util.devices import resolve_device
from modules.util.config.bounds import MAX_BALANCING, MAX_FPS, MAX_REPEATS
from modules.util.config.config_io import ConfigError, load_config
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.config.TrainConfig import TrainConfig
from modules.util.video_io import resample_indices

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PRESETS = sorted(str(path) for path in (ROOT / "training_presets").glob("*.json"))
EXAMPLES = int(os.environ.get("CONFIG_FUZZ_EXAMPLES", "100"))
SECONDS_PER_DOCUMENT = 10     # generous for CI's two shared cores; a document takes milliseconds
MAX_MEMORY_GROWTH = 1 << 30   # peak resident memory may grow by at most 1 GiB over a whole run

# ---- the scratch folder: real, broken and odd paths --------------------------------------------------------------

PATHS = ["model", "squares", "e2v-data", "e2v.json", "e2v_flat.json", "e2v_mutated.json", "samples.txt",
         "binary.safetensors", "not_utf8.json", "deep.json", "digits.json", "model/transformer",
         "model/transformer/config.json", "missing/folder", "out/model.safetensors", "", ".", "/dev/null",
         "/dev/null/x", "ü/ñ 名前", "a" * 300, "x\x00y", "\ud800", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]


@pytest.fixture(scope="module")
def scratch(tiny_model, squares_dataset, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "model").symlink_to(tiny_model("wan2.1-t2v"))
    (folder / "squares").symlink_to(squares_dataset)
    (folder / "e2v-data").mkdir()
    shutil.copy(FIXTURES / "e2v_nested.json", folder / "e2v.json")
    shutil.copy(FIXTURES / "e2v_flat.json", folder / "e2v_flat.json")
    (folder / "samples.txt").write_text("a red square --w 32 --h 32 --f 9 --s 2\n")
    (folder / "binary.safetensors").write_bytes(bytes(range(256)) * 16)
    (folder / "not_utf8.json").write_bytes(b'{"seed": "\xff\xfe"}')
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / "digits.json").write_text('{"datasets": ' + "9" * 5000 + "}")
    cwd = Path.cwd()
    os.chdir(folder)  # generated relative paths resolve here; nothing is written outside it
    yield folder
    os.chdir(cwd)


# ---- value strategies --------------------------------------------------------------------------------------------

texts = st.text(max_size=12) | st.sampled_from(["auto", "cpu", "cuda", "UNIPC", "custom", "LORA", "{run_id}", "1e9",
                                                 "NaN", " ", "é", "\u202e", "中文"])
strings = st.sampled_from(PATHS) | texts
huge_ints = st.sampled_from([-1, 0, 1, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, -(10 ** 30), 10 ** 300])
numbers = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e300, -1e300, 1e-300, 0.0, -0.0])
scalars = st.none() | st.booleans() | st.integers() | huge_ints | numbers | strings
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                        max_leaves=8)


def integers_in(node: dict) -> st.SearchStrategy:
    low, high = node.get("minimum"), node.get("maximum")
    edges = [value for bound in (low, high) if bound is not None for value in (bound - 1, bound, bound + 1)]
    inside = st.integers(min_value=low, max_value=high if high is not None else (low or 0) + 1000)
    return inside | huge_ints | (st.sampled_from(edges) if edges else st.nothing())


def from_schema(node: dict, defs: dict) -> st.SearchStrategy:
    """Values for a JSON-schema node, valid and wrong: every property is optional and may hold any JSON value."""
    if "$ref" in node:
        return from_schema(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in node:
        return st.one_of([from_schema(member, defs) for member in node["anyOf"]])
    if "enum" in node:
        return st.sampled_from(node["enum"]) | st.sampled_from([str(v).lower() for v in node["enum"]])
    if "const" in node:
        return st.just(node["const"])
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        # a wrong value in one property in four: most documents break one rule, some none
        optional = {key: st.one_of(*[from_schema(value, defs)] * 3, any_json)
                    for key, value in node["properties"].items()}
        return st.fixed_dictionaries({}, optional=optional) | st.fixed_dictionaries({}, optional={"typo": any_json})
    if kind == "object":
        extra = node.get("additionalProperties")
        return st.dictionaries(strings, from_schema(extra, defs) if isinstance(extra, dict) else any_json, max_size=3)
    if kind == "array" and "prefixItems" in node:
        return st.tuples(*(from_schema(item, defs) for item in node["prefixItems"])).map(list) | st.lists(numbers)
    if kind == "array":
        return st.lists(from_schema(node.get("items", {}), defs), max_size=4)
    if kind == "integer":
        return integers_in(node)
    if kind == "number":
        return numbers
    if kind == "string":
        return strings
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return any_json


def schema_documents(model) -> st.SearchStrategy:
    schema = model.model_json_schema()
    return from_schema(schema, schema.get("$defs", {}))


def leaf_paths(value, prefix=()):
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from leaf_paths(child, prefix + (key,))


def same_kind(value) -> st.SearchStrategy:
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(min_value=-2 * abs(value) - 2, max_value=2 * abs(value) + 2) | huge_ints
    if isinstance(value, float):
        return numbers | st.floats(min_value=0, max_value=2 * abs(value) + 1)
    if isinstance(value, str):
        return strings | st.just(value.lower())
    if isinstance(value, list):
        return st.lists(st.sampled_from(value), max_size=6) if value else st.just([])
    return st.just(value)


@st.composite
def mutated(draw, document):
    """`document` with one to three values replaced (by an edge value of the same kind or any JSON value),
    deleted, or given an unknown sibling."""
    document = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([p for p in leaf_paths(document) if p]))
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["same kind", "same kind", "replace", "delete", "unknown key"]))
        if action == "same kind":  # an edge value of the kind already there: often still valid, often a bound
            parent[path[-1]] = draw(same_kind(parent[path[-1]]))
        elif action == "replace":
            parent[path[-1]] = draw(any_json)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(texts)] = draw(any_json)
        if not [p for p in leaf_paths(document) if p]:
            break
    return document


DOTTED_KEYS = ["seed", "device", "workspace_dir", "cache_dir", "train_dtype", "data.aspect_ratios",
               "data.concepts.0.fps", "data.concepts.0.repeats", "data.concepts.x.path", "data.concepts.0.path",
               "lora.rank", "lora.targets", "lora.custom_targets", "sampling.scheduler", "e2v.frame_index",
               "e2v.frame_conditioning", "e2v.dataset_config", "optimizer.learning_rate", "output",
               "model.base_model_name", "e2v.datasets.0.elements"]
overrides = st.lists(st.builds("{}={}".format, st.sampled_from(DOTTED_KEYS) | texts,
                               strings | any_json.map(lambda v: json.dumps(v))), max_size=3) | st.just([])

# ---- the property ------------------------------------------------------------------------------------------------


def write_json(path: str, document) -> None:
    text = json.dumps(document, ensure_ascii=False)
    try:
        path_bytes = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: written as the \\udXXX escape a JSON file can hold
        path_bytes = json.dumps(document).encode("ascii")
    Path(path).write_bytes(path_bytes)


def used_before_any_model(config: TrainConfig) -> None:
    """What the trainer does with the values before weights matter, on the real code: the device, the seeds, the
    buckets, each concept's epoch length and a one-second clip resampled to its frame rate. A value the schema let
    through must not break (or blow up) any of them."""
    resolve_device(config.device)
    torch.Generator().manual_seed(config.seed)
    ResolutionBucket.make_buckets(config.data.resolution, config.data.aspect_ratios, 16)
    one_second = [Fraction(i, 16) for i in range(16)]
    for concept in config.data.concepts:
        derive_seed(config.seed + concept.seed, 0, 0, "fuzz")
        assert RepeatConcepts.item_count(24, concept.repeats, concept.balancing) <= 24 * MAX_REPEATS + MAX_BALANCING
        if isinstance(concept.fps, int):
            assert len(resample_indices(one_second, Fraction(1), concept.fps)) <= MAX_FPS
    config.train_dtype.torch_dtype()


def loads_or_is_a_config_error(document, preset: str | None, values: list[str], raw: bytes | None = None) -> None:
    if raw is not None:
        Path("config.json").write_bytes(raw)
    else:
        write_json("config.json", document)
    start = time.monotonic()
    try:
        # demo_assets=false: creating the demo model is seconds of work the user asks for by design, and it
        # would write at generated paths; everything else is as the script runs it
        config = load_config("config.json", preset, values + ["demo_assets=false"])
        prepare_config(config)
        used_before_any_model(config)
        OUTCOMES["loads"] += 1
    except ConfigError as error:
        assert error.problems and all(isinstance(p, str) and p for p in error.problems)
        OUTCOMES["config error"] += 1
        OUTCOMES["problems"] += len(error.problems)
    seconds = time.monotonic() - start
    OUTCOMES["slowest ms"] = max(OUTCOMES["slowest ms"], round(seconds * 1000))
    assert seconds < SECONDS_PER_DOCUMENT


def fuzz_settings():
    return settings(max_examples=EXAMPLES, deadline=timedelta(seconds=SECONDS_PER_DOCUMENT), database=None,
                    suppress_health_check=list(HealthCheck))


def peak_memory() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes


OUTCOMES: Counter = Counter()


@pytest.fixture
def bounded(scratch, request):
    """Peak memory growth over the whole run; the outcomes (printed with -s), of which some must be loads: a
    generator whose documents never get past the schema would test nothing past it."""
    OUTCOMES.clear()
    before, start = peak_memory(), time.monotonic()
    yield
    growth = peak_memory() - before
    print(f"\n{request.node.name}: {OUTCOMES['loads']} loaded, {OUTCOMES['config error']} config errors "
          f"({OUTCOMES['problems']} problems) in {time.monotonic() - start:.1f} s, the slowest "
          f"{OUTCOMES['slowest ms']} ms; peak memory +{growth >> 20} MiB")
    assert growth < MAX_MEMORY_GROWTH
    assert OUTCOMES["loads"] > 0


def test_schema_documents(scratch, bounded):
    version_keys = st.fixed_dictionaries({}, optional={"__version": st.sampled_from([0, 1, 2, "1", None, True, -1]),
                                                       "output_model_destination": strings,
                                                       "output_model_format": strings | any_json})

    @fuzz_settings()
    @given(schema_documents(TrainConfig), version_keys, st.sampled_from(PRESETS + [None]), overrides)
    def check(document, old_keys, preset, values):
        if isinstance(document, dict) and isinstance(document.get("data", {}), dict) and \
                "concepts" not in document.get("data", {}):
            # a config without data is a config error: without a concept none would get past that check
            document = document | {"data": {**document.get("data", {}), "concepts": [{"path": "squares"}]}}
        loads_or_is_a_config_error(document | old_keys if isinstance(document, dict) else document, preset, values)
    check()


def test_preset_mutations(scratch, bounded):
    presets = {}
    for path in PRESETS:
        preset = json.loads(Path(path).read_text(encoding="utf-8"))
        # the presets name models, datasets and samples this machine lacks; pointed at real ones, a mutated preset
        # gets past the path checks to the model and E2V checks (a mutation may break these paths again)
        preset.setdefault("model", {})["base_model_name"] = "model"
        preset.setdefault("data", {})["concepts"] = [{"path": "squares"}]
        if preset.get("sampling", {}).get("samples_file"):
            preset["sampling"]["samples_file"] = "samples.txt"
        presets[path] = preset

    @fuzz_settings()
    @given(st.sampled_from(sorted(presets)).flatmap(lambda p: mutated(presets[p])), overrides,
           st.none() | st.binary(max_size=64))
    def check(document, values, raw):
        # the mutated preset is the config file, over the defaults; raw: the same file holding arbitrary bytes
        loads_or_is_a_config_error(document, None, values, raw)
    check()


def test_e2v_forms(scratch, bounded):
    nested = json.loads((FIXTURES / "e2v_nested.json").read_text(encoding="utf-8"))
    flat = json.loads((FIXTURES / "e2v_flat.json").read_text(encoding="utf-8"))
    # a concept too: a mutated E2V form that names no dataset trains it (no data at all is a config error)
    demo = {"model": {"base_model_name": "model"}, "data": {"concepts": [{"path": "squares"}], "frame_buckets": [17]},
            "sampling": {"samples_file": "samples.txt"}}
    forms = mutated(nested) | mutated(flat) | st.just(nested) | st.just(flat) \
        | st.fixed_dictionaries({"datasets": st.lists(schema_documents(E2VDatasetConfig), min_size=1, max_size=2)})
    seed_options = st.lists(st.sampled_from(["e2v.frame_conditioning=prefix", "e2v.frame_conditioning=index",
                                             "e2v.frame_index=5", "e2v.frame_index=1", "e2v.e2v_type=clip",
                                             "e2v.concatenate_mask=false"]), max_size=3)

    @fuzz_settings()
    @given(forms, st.booleans(), seed_options, overrides)
    def check(e2v_document, as_file, options, values):
        if as_file:
            write_json("e2v_mutated.json", e2v_document)
            e2v = {"dataset_config": "e2v_mutated.json"}
        else:
            datasets = e2v_document.get("datasets", e2v_document) if isinstance(e2v_document, dict) else e2v_document
            e2v = {"datasets": datasets if isinstance(datasets, list) else [datasets]}
        loads_or_is_a_config_error({"__version": 1, **demo, "e2v": e2v}, PRESETS[0], options + values)
    check()

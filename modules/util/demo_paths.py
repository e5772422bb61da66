"""Where the built-in demo ("#demo tiny CPU") keeps its assets. `demo_assets` creates things only at these paths,
and only for a config whose concepts are the demo's own: a user's missing or mistyped folder is a config error, never
a place to generate squares into."""
from pathlib import Path

DEMO_MODEL = "workspace/demo/tiny-wan2.1-t2v"
DEMO_CONCEPT = {"name": "squares", "path": "workspace/demo/squares"}
DEMO_SAMPLES_FILE = "workspace/demo/samples.json"
# what `sample` takes for the demo's model where the command line leaves it unset: the size its squares were trained
# at (demo_squares.DEMO_SIZE, 9 frames) and no guidance (its base was trained without caption dropout)
DEMO_SAMPLE_DEFAULTS = {"width": 16, "height": 16, "frames": 9, "guidance": 1.0}


def same_path(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def is_demo_concept(name: str | None, path: str | Path) -> bool:
    return name == DEMO_CONCEPT["name"] and same_path(path, DEMO_CONCEPT["path"])


def uses_demo_data(config) -> bool:
    """The config trains on the demo's own dataset and nothing else."""
    concepts = list(config.data.concepts)
    return len(concepts) == 1 and is_demo_concept(concepts[0].name, concepts[0].path)

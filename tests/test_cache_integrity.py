"""Issue 15: a damaged cache entry (truncated, emptied, garbled header, a tensor missing, content changed, another
entry copied over it) is reported and encoded again, never a crash and never training on wrong latents."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modules.dataLoader.WanBaseDataLoader import WanBaseDataLoader
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.config_io import load_config
from modules.util.config.ModelConfig import ModelConfig
from modules.util.demo_assets import make_t2v_dataset


def rewrite(path, change):
    """Rewrites the entry with changed tensors but its original metadata (checksum included)."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
    save_file(change(load_file(str(path))), str(path), metadata=metadata)


DAMAGES = {
    "truncated": lambda path, other: path.write_bytes(path.read_bytes()[:-100]),
    "emptied": lambda path, other: path.write_bytes(b""),
    "garbled header": lambda path, other: path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbled: header}"
                                                           + path.read_bytes()[24:]),
    "missing tensor": lambda path, other: rewrite(path, lambda t: {"other": torch.zeros(1)}),
    "sign-flipped": lambda path, other: rewrite(path, lambda t: {k: -v for k, v in t.items()}),
    "another entry copied over it": lambda path, other: shutil.copyfile(other, path),
}


@pytest.fixture(scope="module")
def cached(tiny_model, tmp_path_factory):
    """A filled cache of 3 clips: (a function making a loader on it, the model)."""
    root = tmp_path_factory.mktemp("cache-integrity")
    data = make_t2v_dataset(root / "data", clips_per_class=1)
    for extra in list(data.iterdir()):
        if not extra.stem.startswith(("red_left", "green_left", "blue_left")):
            extra.unlink()
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-t2v"))))

    def loader(cache):
        config = load_config(overrides=[f"data.concepts={json.dumps([{'path': str(data)}])}", f"cache_dir={cache}",
                                        "data.frame_buckets=[9]", "data.resolution=32", "data.aspect_ratios=[1.0]",
                                        "batch_size=1", "data.dataloader_threads=0"])
        result = WanBaseDataLoader(config)
        result.scan()
        result.attach_model(model, torch.device("cpu"))
        return result

    loader(root / "cache").cache()
    return loader, root / "cache"


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_cache_entry_is_encoded_again(damage, cached, tmp_path, caplog):
    make_loader, filled = cached
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    entries = sorted((cache / "latents").rglob("*.safetensors"))
    assert len(entries) == 3
    # copies: load_file maps the file, and the damage below changes one in place
    originals = {path: {k: v.clone() for k, v in load_file(str(path)).items()} for path in entries}
    DAMAGES[damage](entries[0], entries[1])

    loader = make_loader(cache)
    loader.cache()
    assert loader.encoders["EncodeVideo"].encode_calls == 1  # the damaged entry, and only it
    assert loader.encoders["EncodeText"].encode_calls == 0
    notices = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(notices) == 1 and str(entries[0]) in notices[0], notices
    for path, tensors in originals.items():
        again = load_file(str(path))
        assert again.keys() == tensors.keys()
        for name in tensors:
            torch.testing.assert_close(again[name], tensors[name], atol=1e-6, rtol=0)
    assert sum(len(batch["prompt"]) for batch in loader.batches(0)) == 3


def test_the_text_pass_first_writes_the_entries_the_vae_pass_first_wrote(cached, tmp_path):
    """Caching runs the text pass before the VAE pass (the text encoder is released between them): every entry is
    the one the former order (VAE pass, then text pass) writes, byte for byte in its tensors."""
    make_loader, filled = cached   # filled by cache(): the text pass first
    former = make_loader(tmp_path / "former")
    for name in ("EncodeVideo", "EncodeText"):
        former._cache_epoch(0, former.encoders[name])
    files = sorted(p.relative_to(filled) for p in filled.rglob("*.safetensors"))
    assert files == sorted(p.relative_to(tmp_path / "former") for p in (tmp_path / "former").rglob("*.safetensors"))
    assert any("latents" in path.parts for path in files) and any("text" in path.parts for path in files), files
    for path in files:
        now, before = load_file(str(filled / path)), load_file(str(tmp_path / "former" / path))
        assert now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now), path

"""The MGDS-style pipeline core: validation, lazy memoised items, index maps, batching, determinism, threads."""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

from modules.dataLoader.pipeline.BucketBatch import BucketBatch  # noqa: E402
from modules.dataLoader.pipeline.IndexMapModule import IndexMapModule  # noqa: E402
from modules.dataLoader.pipeline.ListSource import ListSource  # noqa: E402
from modules.dataLoader.pipeline.Pipeline import Pipeline  # noqa: E402
from modules.dataLoader.pipeline.PipelineError import PipelineError  # noqa: E402
from modules.dataLoader.pipeline.PipelineModule import PipelineModule, derive_seed  # noqa: E402
from modules.dataLoader.pipeline.RepeatConcepts import RepeatConcepts  # noqa: E402
from modules.dataLoader.pipeline.SourceModule import SourceModule  # noqa: E402
from modules.util.config.DataConfig import ConceptConfig  # noqa: E402


class Numbers(SourceModule):
    def __init__(self, count, name=None):
        super().__init__(name)
        self.count = count

    def produces(self):
        return ["x"]

    def length(self):
        return self.count

    def get_item(self, ctx, index):
        return {"x": index}


class Generic(PipelineModule):
    """Needs `needs`, produces `produces`; each output is a function of the inputs and a draw from the rng."""

    def __init__(self, name, needs, produces, read=None):
        super().__init__(name)
        self._needs, self._produces, self._read = list(needs), list(produces), read
        self.calls = 0
        self._lock = threading.Lock()

    def needs(self):
        return self._needs

    def produces(self):
        return self._produces

    def get_item(self, ctx, index):
        with self._lock:
            self.calls += 1
        values = [ctx.get(name, index) for name in (self._read or self._needs)]
        draw = self.rng(ctx, index).randint(0, 999)
        return {name: (tuple(values), draw) for name in self._produces}


class Noise(PipelineModule):
    def needs(self):
        return ["x"]

    def produces(self):
        return ["y", "bucket", "tensor"]

    def get_item(self, ctx, index):
        x = ctx.get("x", index)
        noise = torch.randn(2, generator=self.torch_rng(ctx, index))
        size = 1 + x % 3
        return {"y": x * 1000 + self.rng(ctx, index).randint(0, 999), "bucket": size,
                "tensor": torch.full((size,), float(x)) + noise.sum()}


class Windows(IndexMapModule):
    """Upstream item u becomes 1 + u % 3 windows (like slide extraction); odd epochs drop item 0 (like skipping)."""

    def __init__(self, name=None):
        super().__init__(name)
        self._map = []

    def needs(self):
        return ["x"]

    def produces(self):
        return ["window"]

    def start_epoch(self, ctx):
        rows = ctx.get_all(["x"])
        self._map = [(u, w) for u, row in enumerate(rows) for w in range(1 + row["x"] % 3)
                     if not (ctx.epoch % 2 and u == 0)]

    def length(self):
        return len(self._map)

    def upstream_index(self, index):
        return self._map[index][0]

    def get_item(self, ctx, index):
        upstream, window = self._map[index]
        return {"window": (ctx.get("x", upstream), window)}


def comparable(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.tolist())
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------------------- validation

def test_missing_producer_names_module_and_item():
    with pytest.raises(PipelineError, match=r"module 'Resize' needs 'video' but nothing before it produces it.*"
                                            r"produced so far: \['x'\]"):
        Pipeline([Numbers(3), Generic("Resize", ["video"], ["out"])], seed=0)


def test_producer_after_consumer_is_reported():
    with pytest.raises(PipelineError, match=r"module 'A' needs 'b'.*module 'B' produces it, but after it"):
        Pipeline([Numbers(3), Generic("A", ["b"], ["a"]), Generic("B", ["x"], ["b"])], seed=0)


def test_duplicate_producer():
    with pytest.raises(PipelineError, match=r"'x' is produced twice: by module 'Numbers' and by module 'Again'"):
        Pipeline([Numbers(3), Generic("Again", [], ["x"])], seed=0)


def test_unknown_and_undeclared_names_at_get():
    typo = Generic("Typo", ["x"], ["t"], read=["xx"])
    pipeline = Pipeline([Numbers(3), typo], seed=0)
    pipeline.start_epoch(0)
    with pytest.raises(PipelineError, match=r"module 'Typo' asked for 'xx', which no module produces"):
        pipeline.get_item(0)

    sneaky = Generic("Sneaky", ["x"], ["s"], read=["y"])
    pipeline = Pipeline([Numbers(3), Generic("MakesY", ["x"], ["y"]), sneaky], seed=0)
    with pytest.raises(PipelineError, match=r"module 'Sneaky' reads 'y' but does not declare it in needs\(\)"):
        pipeline.get_item(0, epoch=0)


def test_bad_outputs_and_structure():
    with pytest.raises(PipelineError, match=r"outputs \['nope'\] are not produced"):
        Pipeline([Numbers(3)], seed=0, outputs=["nope"])
    with pytest.raises(PipelineError, match="first module must be a SourceModule"):
        Pipeline([Generic("G", [], ["g"]), Numbers(3)], seed=0)
    with pytest.raises(PipelineError, match=r"module names must be unique.*'G'"):
        Pipeline([Numbers(3), Generic("G", ["x"], ["a"]), Generic("G", ["x"], ["b"])], seed=0)

    class Liar(Generic):
        def get_item(self, ctx, index):
            return {"wrong": 1}

    pipeline = Pipeline([Numbers(3), Liar("Liar", ["x"], ["right"])], seed=0)
    with pytest.raises(PipelineError, match=r"module 'Liar' returned \['wrong'\].*produces\(\) = \['right'\]"):
        pipeline.get_item(0, epoch=0)
    with pytest.raises(PipelineError, match="call start_epoch"):
        len(Pipeline([Numbers(3)], seed=0))


def test_batch_scope_hides_item_level_names():
    batch = BucketBatch(["y"], batch_size=2, key_names=["bucket"])
    with pytest.raises(PipelineError, match=r"module 'After' needs 'x'.*before the batching module 'BucketBatch'"):
        Pipeline([Numbers(4), Noise(), batch, Generic("After", ["x"], ["z"])], seed=0)
    # a batch may reuse item names, and modules after it read the batched values
    pipeline = Pipeline([Numbers(4), Noise(), BucketBatch(["y"], 2, key_names=["bucket"]),
                         Generic("After", ["y"], ["z"])], seed=0, outputs=["y", "z"])
    first = pipeline.get_item(0, epoch=0)
    assert first["z"][0] == (first["y"],)


# ----------------------------------------------------------------------------------------------------------- items

def test_lazy_memoised_and_translated_through_index_maps():
    make_y = Generic("MakeY", ["x"], ["y"])
    reader_a = Generic("ReadA", ["y", "window"], ["a"])
    reader_b = Generic("ReadB", ["y"], ["b"])
    pipeline = Pipeline([Numbers(5), make_y, Windows(), reader_a, reader_b], seed=3, outputs=["a", "b", "window"])
    items = list(pipeline.iterate(0))
    assert len(items) == sum(1 + u % 3 for u in range(5)) == 9
    windows = [item["window"] for item in items]
    assert windows == [(u, w) for u in range(5) for w in range(1 + u % 3)]
    for item in items:
        upstream = item["window"][0]
        # ReadA and ReadB both read MakeY's output for the item's upstream clip
        assert item["a"][0][0] == ((upstream,), pipeline.modules[1].rng(_Ctx(3, 0), upstream).randint(0, 999))
        assert item["b"][0][0] == item["a"][0][0]
    # MakeY ran once per item computation although two modules read it (and never during start_epoch)
    assert make_y.calls == 9
    assert pipeline.length() == 9 and len(pipeline) == 9
    # odd epochs drop clip 0 (one window)
    assert len(list(pipeline.iterate(1))) == 8


class _Ctx:
    def __init__(self, seed, epoch):
        self.seed, self.epoch = seed, epoch


def test_derive_seed_is_stable_across_processes():
    # sha256-based: the same in every Python process (hash() would be salted per process)
    assert derive_seed(1, 2, 3, "m") == 853416686604250451
    assert derive_seed(1, 2, 3, "m") != derive_seed(1, 2, 4, "m") != derive_seed(1, 3, 3, "m")
    assert derive_seed(1, 2, None, "m") != derive_seed(1, 2, 0, "m")


def test_index_out_of_range_is_an_error():
    pipeline = Pipeline([Numbers(3)], seed=0)
    pipeline.start_epoch(0)
    with pytest.raises(PipelineError, match="index 3, outside 0..2"):
        pipeline.get_item(3)
    with pytest.raises(PipelineError, match="start_index 4 is outside 0..3"):
        pipeline.iterate(0, start_index=4)


# ----------------------------------------------------------------------------------------------------------- batching

def batch_pipeline(seed, threads=0, drop_last=False, batch_size=2):
    return Pipeline([Numbers(11), Noise(), Windows(), BucketBatch(["y", "tensor", "window", "bucket"], batch_size,
                                                                   drop_last=drop_last, key_names=["bucket"])],
                    seed=seed, threads=threads)


def test_batches_have_one_shape_and_cover_every_item():
    pipeline = batch_pipeline(seed=5)
    batches = list(pipeline.iterate(0))
    windows = []
    for batch in batches:
        assert isinstance(batch["tensor"], torch.Tensor)  # stacked: one shape per batch
        assert len(set(batch["bucket"])) == 1
        assert batch["tensor"].shape == (len(batch["y"]), batch["bucket"][0])
        windows += batch["window"]
    expected = [(u, w) for u in range(11) for w in range(1 + u % 3)]
    assert sorted(windows) == expected  # keep incomplete batches: every item once

    dropping = batch_pipeline(seed=5, drop_last=True, batch_size=4)
    batches = list(dropping.iterate(0))
    assert batches and all(len(b["y"]) == 4 for b in batches)
    assert sum(len(b["y"]) for b in batches) + dropping.modules[-1].dropped == len(expected)


def test_same_seed_same_batches_and_epochs_differ():
    first = [comparable(b) for b in batch_pipeline(seed=7).iterate(0)]
    again = [comparable(b) for b in batch_pipeline(seed=7).iterate(0)]
    assert first == again
    other_seed = [comparable(b) for b in batch_pipeline(seed=8).iterate(0)]
    assert other_seed != first
    pipeline = batch_pipeline(seed=7)
    epoch2 = [comparable(b) for b in pipeline.iterate(2)]
    assert epoch2 != first
    # the order changed, and so did the per-item randomness (rng draws depend on the epoch)
    assert [b["window"] for b in epoch2] != [b["window"] for b in first]
    assert sorted(y for b in epoch2 for y in b["y"]) != sorted(y for b in first for y in b["y"])
    # going back to epoch 0 replays it exactly
    assert [comparable(b) for b in pipeline.iterate(0)] == first


def test_resume_mid_epoch_and_thread_count_do_not_change_results():
    full = [comparable(b) for b in batch_pipeline(seed=9).iterate(1)]
    assert len(full) > 4
    for start in (0, 3, len(full) - 1, len(full)):
        fresh = batch_pipeline(seed=9)  # a new process after a resume: nothing carried over but seed and epoch
        assert [comparable(b) for b in fresh.iterate(1, start_index=start)] == full[start:]
    threaded = batch_pipeline(seed=9, threads=2)
    assert [comparable(b) for b in threaded.iterate(1)] == full
    assert [comparable(b) for b in threaded.iterate(1, start_index=2)] == full[2:]
    # item-level pipeline too, with a small prefetch window
    plain = [comparable(i) for i in Pipeline([Numbers(9), Noise()], seed=1).iterate(0)]
    pooled = Pipeline([Numbers(9), Noise()], seed=1, threads=2, prefetch=3)
    assert [comparable(i) for i in pooled.iterate(0)] == plain


def test_breaking_out_of_a_threaded_iteration_is_clean():
    pipeline = batch_pipeline(seed=2, threads=2)
    iterator = pipeline.iterate(0)
    next(iterator)
    iterator.close()  # shuts the workers down
    assert len(list(pipeline.iterate(0))) == len(pipeline)


# ----------------------------------------------------------------------------------------------------------- repeats

def test_repeat_concepts_counts_and_fractional_subsets():
    a = ConceptConfig(name="a", path="a", repeats=2.5)
    b = ConceptConfig(name="b", path="b", balancing=3)
    records = [{"x": i, "concept": a} for i in range(4)] + [{"x": 10 + i, "concept": b} for i in range(2)]

    def run(epoch):
        pipeline = Pipeline([ListSource(records, ["x", "concept"]), RepeatConcepts()], seed=4, outputs=["x"])
        return [item["x"] for item in pipeline.iterate(epoch)]

    epochs = [run(e) for e in range(6)]
    for xs in epochs:
        assert len(xs) == 10 + 3  # round(4 x 2.5) + balancing 3
        assert all(xs.count(i) in (2, 3) for i in range(4))
        assert all(xs.count(10 + i) in (1, 2) for i in range(2))
    assert len({tuple(xs) for xs in epochs}) > 1  # the remainder subset changes between epochs
    assert run(3) == epochs[3]

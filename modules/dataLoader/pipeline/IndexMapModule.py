from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class IndexMapModule(PipelineModule):
    """A module that changes the item count: its own index i stands for upstream index `upstream_index(i)`.

    Several indices may map to the same upstream index (windows of one clip, repeats) and upstream indices may be
    left out (skipped files) or reordered. The map is computed in `start_epoch` (it may differ per epoch, e.g. a
    random subset for fractional repeats) and then read-only.

    Modules after it address items in its index space; when they read an item produced before it, the pipeline
    translates the index through `upstream_index`. Inside its own `get_item(ctx, index)`, `ctx.get(name, j)` takes
    an upstream index j (usually `self.upstream_index(index)`).
    """

    def length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define length()")

    def upstream_index(self, index: int) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define upstream_index()")

    def produces(self) -> list[str]:
        return []

    def get_item(self, ctx, index: int) -> dict:
        return {}

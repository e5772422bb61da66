from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class GatherModule(PipelineModule):
    """A module whose item i combines several upstream items (`upstream_indices(i)`): a batch.

    It opens a new scope: the modules after it see only the names it produces (which may reuse upstream names,
    e.g. a batch's 'video' stacks the items' 'video'); upstream items are no longer addressable by index.
    Inside its own `get_item`, `ctx.get(name, j)` takes an upstream index j.
    """

    def length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define length()")

    def upstream_indices(self, index: int) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} must define upstream_indices()")

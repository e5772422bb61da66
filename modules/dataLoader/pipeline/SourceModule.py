from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class SourceModule(PipelineModule):
    """The first module of a pipeline: needs nothing, defines the item count with `length()`."""

    def needs(self) -> list[str]:
        return []

    def length(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define length()")

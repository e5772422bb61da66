from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modules.dataLoader.pipeline.Pipeline import Pipeline, _Run
    from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class PipelineContext:
    """What a module sees while it works: the epoch, the seed, and the items of the modules before it.

    `get(name, index)` takes an index in the module's input index space: for a plain module that is its own index,
    for an IndexMapModule / GatherModule an upstream index. One context serves one item computation (or one
    start_epoch call); within an item computation every upstream item is computed once (memoised).
    """

    def __init__(self, pipeline: Pipeline, position: int, epoch: int, run: _Run | None,
                 executor: Executor | None = None):
        self._pipeline = pipeline
        self._position = position
        self._run = run
        self._executor = executor
        self.epoch = epoch
        self.seed = pipeline.seed

    @property
    def module(self) -> PipelineModule | None:
        modules = self._pipeline.modules
        return modules[self._position] if self._position < len(modules) else None

    def get(self, name: str, index: int) -> Any:
        """The item `name` at `index` (input index space); raises PipelineError for an undeclared or unknown
        name or an index out of range, never returns a silent None."""
        run = self._run if self._run is not None else self._pipeline._new_run(self.epoch)
        return self._pipeline._read(self._position, name, index, run)

    def get_all(self, names: list[str], indices: list[int] | range | None = None) -> list[dict[str, Any]]:
        """Rows {name: value} for each index (default: every upstream index). In start_epoch the rows are computed
        by the pipeline's worker threads when it has any; rows are always returned in the order of `indices`."""
        if indices is None:
            indices = range(self.upstream_length())
        if self._run is not None or self._executor is None:
            return [self._row(names, index, self._run) for index in indices]
        return list(self._executor.map(lambda index: self._row(names, index, None), indices))

    def _row(self, names: list[str], index: int, run: _Run | None) -> dict[str, Any]:
        run = run if run is not None else self._pipeline._new_run(self.epoch)
        return {name: self._pipeline._read(self._position, name, index, run) for name in names}

    def upstream_length(self) -> int:
        """The item count of this module's input index space."""
        return self._pipeline._input_length(self._position)

"""The MGDS-style pipeline: an ordered list of modules, validated once, pulled lazily per (epoch, index).

Index spaces. The first module (a SourceModule) defines the item count. A plain module keeps the indexing of the
module before it. An IndexMapModule defines a new count and maps each of its indices to one upstream index (clip
windows, repeats, skipping unusable files, reordering); when a later module reads an item produced before the
mapper, the pipeline translates the index through every mapper in between. A GatherModule (batching) combines
several upstream items into one and opens a new scope: after it only its own names exist.

Validation at build time: exactly one SourceModule, first; unique module names; every needed name produced by
exactly one module earlier in the same scope; no name produced twice in a scope; the requested outputs exist.
At run time: a module may read only the names it declared (a typo is an error naming the module and the item,
never a silent None); every module must return exactly the names it declared.

Determinism. Each item is a pure function of (seed, epoch, index): modules draw randomness from `rng(ctx, index)`,
index maps are fixed in `start_epoch`, and worker threads only compute items ahead while `iterate` yields them in
index order, so the results do not depend on the thread count, and `iterate(epoch, start_index=k)` yields exactly
the tail of the full epoch (resume).

One pipeline serves one epoch at a time: `iterate(e)` (or `start_epoch(e)`) moves every module to epoch e.
"""
from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from modules.dataLoader.pipeline.GatherModule import GatherModule
from modules.dataLoader.pipeline.IndexMapModule import IndexMapModule
from modules.dataLoader.pipeline.PipelineContext import PipelineContext
from modules.dataLoader.pipeline.PipelineError import PipelineError
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.dataLoader.pipeline.SourceModule import SourceModule


class _Run:
    """The memo of one item computation: (module position, index in its output space) -> its outputs."""

    __slots__ = ("epoch", "memo")

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.memo: dict[tuple[int, int], dict[str, Any]] = {}


class Pipeline:
    def __init__(self, modules: list[PipelineModule], seed: int, threads: int = 0,
                 outputs: list[str] | None = None, prefetch: int | None = None):
        """`threads`: worker threads that compute items ahead (0: compute in the caller's thread).
        `outputs`: the names each yielded item holds (default: every name visible at the end, which after a
        GatherModule is just what it produces). `prefetch`: items in flight (default 2 x threads)."""
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        self.modules = list(modules)
        self.seed = int(seed)
        self.threads = int(threads)
        self.prefetch = max(1, prefetch if prefetch is not None else 2 * self.threads)
        self._epoch: int | None = None
        self._scopes: list[dict[str, int]] = []  # for each position (and len(modules)): name -> producer position
        self._space: list[int] = []  # for each position: the position that defines its output index space
        self._mappers: set[int] = set()
        self._validate()
        self._needs = [frozenset(module.needs()) for module in self.modules]  # needs / produces are fixed at build
        self._produces = [frozenset(module.produces()) for module in self.modules]
        final_scope = self._scopes[len(self.modules)]
        self.outputs = list(outputs) if outputs is not None else list(final_scope)
        self._outputs_set = frozenset(self.outputs)
        missing = [name for name in self.outputs if name not in final_scope]
        if missing:
            raise PipelineError(f"the pipeline outputs {missing} are not produced (at the end of the pipeline the "
                                f"items are: {sorted(final_scope)})")

    # ------------------------------------------------------------------------------------------------ validation

    def _validate(self) -> None:
        if not self.modules:
            raise PipelineError("a pipeline needs at least one module")
        for position, module in enumerate(self.modules):
            if not isinstance(module, PipelineModule):
                raise PipelineError(f"pipeline entry {position} is {module!r}, not a PipelineModule")
        names = [module.name for module in self.modules]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise PipelineError(f"module names must be unique (they seed the randomness); repeated: {duplicates}")
        if not isinstance(self.modules[0], SourceModule):
            raise PipelineError(f"the first module must be a SourceModule (it defines the item count); "
                                f"got '{self.modules[0].name}'")

        scope: dict[str, int] = {}
        all_producers: dict[str, list[int]] = {}
        gather_before: int | None = None
        space = 0
        for position, module in enumerate(self.modules):
            if position > 0 and isinstance(module, SourceModule):
                raise PipelineError(f"module '{module.name}' is a SourceModule but is not first; a pipeline has "
                                    f"exactly one source")
            needs = list(module.needs())
            produces = list(module.produces())
            for name in needs:
                if name not in scope:
                    raise PipelineError(self._missing_message(module, name, scope, all_producers, position,
                                                              gather_before))
            self._scopes.append(dict(scope))
            repeated = sorted({name for name in produces if produces.count(name) > 1})
            if repeated:
                raise PipelineError(f"module '{module.name}' lists {repeated} more than once in produces()")
            if isinstance(module, GatherModule):
                scope = {}
                gather_before = position
            for name in produces:
                if name in scope:
                    raise PipelineError(f"'{name}' is produced twice: by module '{self.modules[scope[name]].name}' "
                                        f"and by module '{module.name}'")
                scope[name] = position
                all_producers.setdefault(name, []).append(position)
            if isinstance(module, (SourceModule, IndexMapModule, GatherModule)):
                space = position
            if isinstance(module, IndexMapModule):
                self._mappers.add(position)
            self._space.append(space)
        self._scopes.append(dict(scope))

    def _missing_message(self, module: PipelineModule, name: str, scope: dict[str, int],
                         all_producers: dict[str, list[int]], position: int, gather_before: int | None) -> str:
        message = f"module '{module.name}' needs '{name}' but nothing before it produces it"
        if name in all_producers and gather_before is not None:
            producer = self.modules[all_producers[name][-1]].name
            message += (f" (module '{producer}' produces it before the batching module "
                        f"'{self.modules[gather_before].name}', after which only the batch's items exist)")
        else:
            later = [m.name for m in self.modules[position + 1:] if name in m.produces()]
            if later:
                message += f" (module '{later[0]}' produces it, but after it: move it earlier)"
        return message + f"; produced so far: {sorted(scope)}"

    # ------------------------------------------------------------------------------------------------ epochs

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def start_epoch(self, epoch: int) -> None:
        """Moves every module to `epoch` (index maps, shuffles), in pipeline order."""
        epoch = int(epoch)
        executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pipeline") if self.threads else None
        try:
            self._epoch = None  # a failure half-way must not leave a pipeline that looks ready
            for position, module in enumerate(self.modules):
                module.start_epoch(PipelineContext(self, position, epoch, None, executor))
            self._epoch = epoch
        finally:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)

    def __len__(self) -> int:
        self._require_epoch()
        return self._output_length(len(self.modules) - 1)

    def length(self) -> int:
        return len(self)

    def _require_epoch(self) -> None:
        if self._epoch is None:
            raise PipelineError("call start_epoch(epoch) (or iterate(epoch)) before reading items")

    # ------------------------------------------------------------------------------------------------ items

    def get_item(self, index: int, epoch: int | None = None) -> dict[str, Any]:
        """The outputs at `index` of `epoch` (default: the current epoch)."""
        if epoch is not None and epoch != self._epoch:
            self.start_epoch(epoch)
        self._require_epoch()
        return self._compute(index, self._epoch)

    def iterate(self, epoch: int, start_index: int = 0) -> Iterator[dict[str, Any]]:
        """Yields the items of `epoch` from `start_index` on, in order; worker threads compute ahead."""
        if epoch != self._epoch:
            self.start_epoch(epoch)
        count = len(self)
        if not 0 <= start_index <= count:
            raise PipelineError(f"start_index {start_index} is outside 0..{count} for epoch {epoch}")
        return self._iterate(epoch, start_index, count)

    def _iterate(self, epoch: int, start_index: int, count: int) -> Iterator[dict[str, Any]]:
        if self.threads == 0:
            for index in range(start_index, count):
                yield self._compute(index, epoch)
            return
        executor = ThreadPoolExecutor(self.threads, thread_name_prefix="pipeline")
        pending: deque[Future] = deque()
        try:
            next_index = start_index
            while next_index < count or pending:
                while next_index < count and len(pending) < self.prefetch:
                    pending.append(executor.submit(self._compute, next_index, epoch))
                    next_index += 1
                yield pending.popleft().result()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)

    def _compute(self, index: int, epoch: int) -> dict[str, Any]:
        run = _Run(epoch)
        caller = len(self.modules)
        return {name: self._read(caller, name, index, run) for name in self.outputs}

    @staticmethod
    def _new_run(epoch: int) -> _Run:
        return _Run(epoch)

    def _who(self, caller: int) -> str:
        return "the pipeline output" if caller == len(self.modules) else f"module '{self.modules[caller].name}'"

    def _read(self, caller: int, name: str, index: int, run: _Run) -> Any:
        """The item `name` at `index` in the input index space of the module at position `caller`."""
        declared = self._outputs_set if caller == len(self.modules) else self._needs[caller]
        if name not in declared:
            producers = [m.name for m in self.modules if name in m.produces()]
            if not producers:
                known = sorted({n for m in self.modules for n in m.produces()})
                raise PipelineError(f"{self._who(caller)} asked for '{name}', which no module produces "
                                    f"(known items: {known})")
            raise PipelineError(f"{self._who(caller)} reads '{name}' but does not declare it in needs() "
                                f"(declared: {sorted(declared)}; '{name}' comes from module '{producers[0]}')")
        producer = self._scopes[caller][name]
        size = self._input_length(caller)
        try:
            index = operator.index(index)
        except TypeError:
            raise PipelineError(f"{self._who(caller)} read '{name}' with a non-integer index {index!r}") from None
        if not 0 <= index < size:
            raise PipelineError(f"{self._who(caller)} read '{name}' at index {index!r}, outside 0..{size - 1}")
        for position in range(caller - 1, producer, -1):
            if position in self._mappers:
                index = self.modules[position].upstream_index(index)
        key = (producer, index)
        outputs = run.memo.get(key)
        if outputs is None:
            outputs = self._compute_module(producer, index, run)
        return outputs[name]

    def _compute_module(self, position: int, index: int, run: _Run) -> dict[str, Any]:
        module = self.modules[position]
        size = self._output_length(position)
        if not 0 <= index < size:
            raise PipelineError(f"module '{module.name}' was asked for index {index}, outside 0..{size - 1} "
                                f"(an index map after it returned a bad upstream index)")
        outputs = module.get_item(PipelineContext(self, position, run.epoch, run), index)
        expected = self._produces[position]
        if not isinstance(outputs, dict) or outputs.keys() != expected:
            got = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
            raise PipelineError(f"module '{module.name}' returned {got} for index {index}; it declares "
                                f"produces() = {sorted(expected)}")
        run.memo[(position, index)] = outputs
        return outputs

    def _output_length(self, position: int) -> int:
        return self.modules[self._space[position]].length()

    def _input_length(self, position: int) -> int:
        if position == 0:
            return 0
        return self._output_length(position - 1)

    # ------------------------------------------------------------------------------------------------ reports

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """(file, reason) for every input a module skipped in the current epoch (modules with a `skipped` list)."""
        result: list[tuple[str, str]] = []
        for module in self.modules:
            result.extend(getattr(module, "skipped", []) or [])
        return result

    def __repr__(self) -> str:
        return f"Pipeline([{', '.join(m.name for m in self.modules)}], seed={self.seed}, threads={self.threads})"

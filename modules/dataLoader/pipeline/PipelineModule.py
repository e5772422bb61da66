"""The base class of every pipeline module (see Pipeline.py for how modules are wired together)."""
from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from modules.dataLoader.pipeline.PipelineContext import PipelineContext


def derive_seed(seed: int, epoch: int, index: int | None, name: str) -> int:
    """A 64-bit seed that is a pure function of (pipeline seed, epoch, index, module name): sha256, not hash()."""
    key = f"{int(seed)}|{int(epoch)}|{'epoch' if index is None else int(index)}|{name}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


class PipelineModule:
    """One step of a pipeline: reads the items it `needs` from the modules before it, returns the items it
    `produces`, for one index at a time.

    A plain module keeps the item count and the indexing of the module before it. Subclasses that change them:
    `SourceModule` (the first module: defines the item count), `IndexMapModule` (a new count whose indices each
    map to one upstream index: windows, repeats, filtering, reordering) and `GatherModule` (each index combines
    several upstream indices: batches).

    `get_item` must be a pure function of (module settings, what it reads, ctx.epoch, index) and must not change the
    module's state, so items can be computed in any order, in several threads, and replayed after a resume.
    Randomness comes from `rng` / `torch_rng`, never from global generators.
    """

    def __init__(self, name: str | None = None):
        self.name = name or type(self).__name__

    def needs(self) -> list[str]:
        """The item names this module reads with ctx.get (reading any other name is an error)."""
        return []

    def produces(self) -> list[str]:
        """The item names get_item returns (exactly these keys)."""
        raise NotImplementedError(f"{type(self).__name__} must define produces()")

    def length(self) -> int | None:
        """The item count after this module; None for modules that keep the upstream count."""
        return None

    def start_epoch(self, ctx: PipelineContext) -> None:
        """Called once per epoch, in pipeline order, before any item of that epoch is computed; modules that
        change the item count compute their index map here (they may read upstream items with ctx.get_all)."""

    def get_item(self, ctx: PipelineContext, index: int) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define get_item()")

    def rng(self, ctx: PipelineContext, index: int, concept_seed: int = 0) -> random.Random:
        """A Python generator seeded by (pipeline seed, epoch, index, module name), shifted by the item's concept
        seed where a module's randomness belongs to the concept (a concept's seed changes only its own draws)."""
        return random.Random(derive_seed(ctx.seed + concept_seed, ctx.epoch, index, self.name))

    def torch_rng(self, ctx: PipelineContext, index: int) -> torch.Generator:
        """A torch CPU generator seeded by (pipeline seed, epoch, index, module name)."""
        generator = torch.Generator()
        generator.manual_seed(derive_seed(ctx.seed, ctx.epoch, index, self.name))
        return generator

    def epoch_rng(self, ctx: PipelineContext) -> random.Random:
        """A Python generator for decisions about a whole epoch (shuffles), seeded by (seed, epoch, module name)."""
        return random.Random(derive_seed(ctx.seed, ctx.epoch, None, self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

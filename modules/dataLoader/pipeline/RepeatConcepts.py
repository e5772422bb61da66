from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from modules.dataLoader.pipeline.IndexMapModule import IndexMapModule


def _concept_key(concept: Any) -> Hashable:
    if hasattr(concept, "model_dump_json"):
        return concept.model_dump_json()
    return concept if isinstance(concept, Hashable) else repr(concept)


class RepeatConcepts(IndexMapModule):
    """Repeats each concept's items per epoch: `balancing` items when set, else round(items x `repeats`).

    A count that is not a whole multiple of the concept's item count takes every item floor(count / n) times plus
    a random subset (new each epoch, from the module's epoch rng) for the remainder. Concepts are told apart by
    their settings (the `concept` item, a ConceptConfig); the map lists concepts in order of first appearance.
    """

    def __init__(self, concept_name: str = "concept", name: str | None = None):
        super().__init__(name)
        self.concept_name = concept_name
        self._map: list[int] = []

    def needs(self) -> list[str]:
        return [self.concept_name]

    def start_epoch(self, ctx) -> None:
        groups: dict[Hashable, tuple[Any, list[int]]] = {}
        for index, row in enumerate(ctx.get_all([self.concept_name])):
            concept = row[self.concept_name]
            groups.setdefault(_concept_key(concept), (concept, []))[1].append(index)
        rng = self.epoch_rng(ctx)
        mapping: list[int] = []
        for concept, members in groups.values():
            count = self.item_count(len(members), getattr(concept, "repeats", 1.0), getattr(concept, "balancing", None))
            whole, rest = divmod(count, len(members))
            mapping.extend(members * whole)
            mapping.extend(sorted(rng.sample(members, rest)))
        self._map = mapping

    @staticmethod
    def item_count(items: int, repeats: float, balancing: int | None) -> int:
        if balancing is not None:
            return int(balancing)
        return int(math.floor(items * float(repeats) + 0.5))

    def length(self) -> int:
        return len(self._map)

    def upstream_index(self, index: int) -> int:
        return self._map[index]

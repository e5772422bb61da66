from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from modules.dataLoader.pipeline.GatherModule import GatherModule


def _freeze(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return tuple(value.tolist()) if value.ndim else value.item()
    return value


class BucketBatch(GatherModule):
    """Groups items into batches whose items share one bucket key (by default (frame_bucket, resolution_bucket),
    i.e. (frames, height, width)), so every batch has one shape.

    Per epoch (deterministic from the pipeline seed): the items of each bucket are shuffled, cut into batches of
    `batch_size` (a bucket's incomplete last batch is dropped when `drop_last`), and the batches are shuffled.
    Its item i is batch i: the `names` of its members collated (tensors or arrays of one shape stacked along a new
    first axis, anything else as a list). The bucket keys are read for every item in start_epoch, so they should
    be cheap (from probing, not decoding).
    """

    def __init__(self, names: list[str], batch_size: int, drop_last: bool = False, shuffle: bool = True,
                 key_names: tuple[str, ...] | list[str] = ("frame_bucket", "resolution_bucket"),
                 name: str | None = None):
        super().__init__(name)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.names = list(names)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.key_names = list(key_names)
        self._batches: list[list[int]] = []
        self.dropped = 0  # items left out of the current epoch by drop_last

    def needs(self) -> list[str]:
        return list(dict.fromkeys(self.names + self.key_names))

    def produces(self) -> list[str]:
        return list(self.names)

    def start_epoch(self, ctx) -> None:
        rows = ctx.get_all(self.key_names)
        groups: dict[Hashable, list[int]] = {}
        for index, row in enumerate(rows):
            groups.setdefault(_freeze([row[k] for k in self.key_names]), []).append(index)
        rng = self.epoch_rng(ctx)
        batches: list[list[int]] = []
        dropped = 0
        for members in groups.values():
            if self.shuffle:
                rng.shuffle(members)
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                if len(batch) < self.batch_size and self.drop_last:
                    dropped += len(batch)
                    continue
                batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)
        self._batches = batches
        self.dropped = dropped

    def length(self) -> int:
        return len(self._batches)

    def upstream_indices(self, index: int) -> list[int]:
        return list(self._batches[index])

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        members = self._batches[index]
        return {name: self.collate([ctx.get(name, member) for member in members]) for name in self.names}

    @staticmethod
    def collate(values: list[Any]) -> Any:
        """Stacks tensors (or numpy arrays) of one shape and dtype; anything else becomes a list."""
        if values and all(isinstance(v, torch.Tensor) for v in values):
            if len({(tuple(v.shape), v.dtype) for v in values}) == 1:
                return torch.stack(values)
        if values and all(isinstance(v, np.ndarray) for v in values):
            if len({(v.shape, v.dtype) for v in values}) == 1:
                return np.stack(values)
        return list(values)

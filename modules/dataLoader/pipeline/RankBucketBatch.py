from __future__ import annotations

from typing import Any

import torch

from modules.dataLoader.pipeline.BucketBatch import BucketBatch


class RankBucketBatch(BucketBatch):
    """BucketBatch for one rank of a multi-process run: the epoch's global batches are exactly the single-process
    batches of `batch_size x world_size` items, and rank r takes places [r*batch_size, (r+1)*batch_size) of each.
    So one seed gives the same global batches on any world size, and every rank's items share one bucket shape.

    Besides the collated `names` it produces `item_index`: each item's place in its global batch (the trainer
    derives the item's noise from it, so an item gets the same noise in one process as dealt out to several).

    A bucket's last global batch may hold fewer items than the ranks need (n < batch_size x world_size): it is
    padded by repeating its own items, and `weight_name` (the per-item loss weight) is scaled by
    `real x global / n`, where `real` is 0 for a padding item. The mean of the ranks' mean losses is then the
    mean over the n real items, as in one process. Without padding every scale is exactly 1.
    """

    def __init__(self, names: list[str], batch_size: int, rank: int = 0, world_size: int = 1,
                 weight_name: str = "loss_weight", drop_last: bool = False, shuffle: bool = True,
                 key_names: tuple[str, ...] | list[str] = ("frame_bucket", "resolution_bucket"),
                 name: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        # the global batch is what BucketBatch cuts; the name seeds the shuffle, and keeping BucketBatch's makes
        # single-process orders equal to those of runs made before ranks existed
        super().__init__(names, batch_size * world_size, drop_last, shuffle, key_names, name or "BucketBatch")
        self.per_rank = int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.weight_name = weight_name

    def produces(self) -> list[str]:
        return list(self.names) + ["item_index"]

    def _share(self, index: int) -> tuple[list[int], list[int], int]:
        """(upstream members, places in the global batch, real items in the global batch) of this rank."""
        members = self._batches[index]
        real = len(members)
        if self.world_size == 1:
            return list(members), list(range(real)), real
        places = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        # padding items repeat the batch's own members: same bucket, so the same shape
        return [members[p % real] for p in places], list(places), real

    def upstream_indices(self, index: int) -> list[int]:
        return list(dict.fromkeys(self._share(index)[0]))

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        members, places, real = self._share(index)
        batch = {name: self.collate([ctx.get(name, member) for member in members]) for name in self.names}
        batch["item_index"] = torch.tensor(places, dtype=torch.long)
        if self.world_size > 1 and self.weight_name in batch:
            scale = self.batch_size / real
            batch[self.weight_name] = [float(w) * (scale if p < real else 0.0)
                                       for w, p in zip(batch[self.weight_name], places)]
        return batch

from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule


class ApplyConceptSettings(PipelineModule):
    """The per-item effects of the concept settings: caption dropout (an empty prompt, drawn anew each epoch) and
    the loss weight."""

    def needs(self) -> list[str]:
        return ["caption", "concept"]

    def produces(self) -> list[str]:
        return ["prompt", "loss_weight"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        concept = ctx.get("concept", index)
        dropped = self.rng(ctx, index, concept.seed).random() < concept.caption_dropout
        return {"prompt": "" if dropped else ctx.get("caption", index), "loss_weight": float(concept.loss_weight)}

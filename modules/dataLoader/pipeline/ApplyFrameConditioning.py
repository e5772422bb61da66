from typing import Any

from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.e2v_condition import apply_frame_conditioning, condition_from_cache
from modules.util.config.E2VConfig import E2VDatasetConfig


class ApplyFrameConditioning(PipelineModule):
    """Per training step (epoch, index), the reference slots frame_conditioning keeps; the condition for them is
    assembled from the cached latents without a VAE call. Dropped slots are empty (grey, mask 0)."""

    def __init__(self, model, dataset: E2VDatasetConfig, name: str | None = None):
        super().__init__(name)
        self.model, self.dataset = model, dataset

    def needs(self) -> list[str]:
        return ["e2v_condition_cache", "e2v_present", "frame_bucket"]

    def produces(self) -> list[str]:
        return ["condition"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        vae = self.dataset.processors.vae
        present = [bit == "1" for bit in ctx.get("e2v_present", index)]
        if self.dataset.uses_vae:
            kept = apply_frame_conditioning(present, vae.frame_conditioning, vae.frame_index,
                                            self.torch_rng(ctx, index))
            combine = vae.combine
        else:
            kept, combine = [False] * len(present), "before"
        condition = condition_from_cache(self.model, ctx.get("e2v_condition_cache", index), kept,
                                         self.dataset.repeats(), ctx.get("frame_bucket", index), combine,
                                         vae.concatenate_mask)
        return {"condition": condition}

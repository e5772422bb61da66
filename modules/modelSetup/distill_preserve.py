"""`distill.mode` "preserve" (docs/distilled.md): the LoRA trains with the accelerator attached and frozen, plus a
preservation term, so that what it learns holds on the accelerator's few steps.

Attached: each training step's forward and backward run inside `accelerated` (modules/modelSampler/accelerator.py),
the accelerator's low-rank modules as forward hooks on the base layers and its full deltas added to the base weights
and copied back after, exactly as the accelerated previews run it. The hooks and deltas hold no trainable parameter
and are not peft adapters, so the optimizer, the backups and the saved LoRA hold the user's adapter only.

The preservation term is teacher matching on the empty caption (`preserve_on` "empty_caption", the default): the
step's noisy latents, timestep and conditions with the empty caption, through the trained model and again with the
user's adapter disabled and no gradient (the frozen accelerated model: the teacher), and

    loss = mse(prediction, noise - x0) + preserve_weight * mse(prediction on "", teacher on "")

ai-toolkit's differential output preservation (`diff_output_preservation`, its class prompt here the empty caption),
with the frozen accelerated model as the model without the LoRA. `preserve_on` "caption" compares on the step's own
inputs (the trained side is then the step's prediction: one pass less). Training an accelerated model on the data
term alone pulls its few-step predictions back toward the many-step model's averaged ones (the distillation "breaks
down", as ostris describes for training on FLUX.1-schnell, huggingface.co/ostris/FLUX.1-schnell-training-adapter).
The measurement that chose the empty caption is in docs/distilled.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor


class PreserveTraining:
    """A run's frozen accelerator and preservation weight."""

    def __init__(self, accelerator, weight: float, empty_text: Tensor | None = None):
        self.accelerator = accelerator   # modules.modelSampler.accelerator.Accelerator; None on a distilled release
        self.weight = weight
        # preserve_on "empty_caption": the empty caption's text embeddings (1, L, D); None: the step's own caption
        self.empty_text = empty_text

    @staticmethod
    def empty_caption(config, model) -> Tensor | None:
        """The empty caption's embeddings when the term compares on it (encoded once, before the text encoder is
        released)."""
        if config.distill.preserve_on != "empty_caption" or config.distill.preserve_weight == 0:
            return None
        with torch.no_grad():
            return model.encode_text([""]).float().cpu()

    @classmethod
    def for_run(cls, config, model, device: torch.device) -> PreserveTraining | None:
        """None unless `distill.mode` is "preserve" (the config checks have made sure the accelerator is set). The
        low-rank factors are placed on `device` in the dtype the hooks compute in once, not at every step."""
        if config.distill.mode != "preserve":
            return None
        empty_text = cls.empty_caption(config, model)
        if not config.sampling.accelerator.enabled:   # a distilled release: the teacher is the release itself
            return cls(None, config.distill.preserve_weight, empty_text)
        from modules.modelSampler.accelerator import _module_names, load_accelerator
        from modules.util.lora.apply import _base_layer, _get_module
        from modules.util.lora.formats import match_to_model
        accelerator = load_accelerator(model, config.sampling.accelerator)
        for expert, file in accelerator.files.items():
            transformer = getattr(model, expert)
            file.lora = match_to_model(file.lora, _module_names(transformer))
            for name, lora in file.lora.items():
                weight = _base_layer(_get_module(transformer, name)).weight
                dtype = weight.dtype if weight.dtype.is_floating_point and weight.element_size() > 1 \
                    else torch.bfloat16   # as `accelerated` computes them
                lora.down, lora.up = lora.down.to(device, dtype), lora.up.to(device, dtype)
        return cls(accelerator, config.distill.preserve_weight, empty_text)

    def attached(self, model) -> contextlib.AbstractContextManager:
        """Held around a training step's forward and backward (a checkpointed block recomputes under it)."""
        from modules.modelSampler.accelerator import accelerated
        return accelerated(model, self.accelerator)   # None: nothing to attach

    def preservation(self, transformer: torch.nn.Module, forward: Callable[[Tensor], Tensor], text: Tensor,
                     predicted: Tensor) -> tuple[Tensor, Tensor] | None:
        """(the trained model's prediction on the term's inputs, the teacher's there): `forward(text)` with the
        user's adapters disabled and no gradient is the frozen accelerated model's prediction; on the step's own
        caption the trained prediction is `predicted`, on the empty caption one more pass with the adapters. None
        when the term is off or no gradient is being taken (validation, previews)."""
        if self.weight == 0 or not torch.is_grad_enabled():
            return None
        if self.empty_text is not None:
            # (1, L, D) -> (B, L, D): every item's noisy latents with the empty caption
            text = self.empty_text.to(text.device, text.dtype).expand(text.shape[0], -1, -1)
            predicted = forward(text)
        transformer.disable_adapters()
        try:
            with torch.no_grad():
                return predicted, forward(text)
        finally:
            transformer.enable_adapters()

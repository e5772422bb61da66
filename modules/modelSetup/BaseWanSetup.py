"""What every training method shares: the forward pass (predict) and the flow-matching loss, for every Wan variant.
The methods (LoRA, fine-tune, embedding) differ only in which parameters train and how they are saved."""
import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.model.WanModel import WanModel
from modules.model.animate_condition import transformer_condition
from modules.modelSetup.loss_masks import mask_loss_weights
from modules.modelSetup.timestep_sampling import sample_sigmas
from modules.util.config.TrainConfig import TrainConfig

NUM_TRAIN_TIMESTEPS = 1000


@dataclass
class Prediction:
    predicted: Tensor     # v, (B, z, T, h, w)
    target: Tensor        # noise - x0
    x0: Tensor            # normalised clean latents
    noisy: Tensor         # x_t
    sigmas: Tensor        # (B,)
    expert: str           # "transformer" or "transformer_2"
    loss_mask: Tensor | None = None  # (B, 1, T, 1 or h, 1 or w): the loss weight of each latent (0: no loss)
    # distill.mode preserve: the trained model's and the frozen accelerated model's v on the term's inputs
    preserved: Tensor | None = None
    teacher: Tensor | None = None

    @property
    def predicted_x0(self) -> Tensor:
        """x0 estimate: x_t = (1-s) x0 + s n and v = n - x0 give x0 = x_t - s v."""
        return self.noisy - self.sigmas.view(-1, 1, 1, 1, 1) * self.predicted


class BaseWanSetup:
    def __init__(self, config: TrainConfig, model: WanModel):
        self.config = config
        self.model = model
        self.device = torch.device("cpu")
        # expert parallel (modules/trainer/expert_parallel.py): the expert every step of this rank trains, over its
        # own sigma range, as `expert: high` / `low` does; None: the steps are routed over experts_in_training()
        self.only_expert: str | None = None
        # distill.mode "preserve" (modules/modelSetup/distill_preserve.py): set by the trainer once the model is set up
        self.preserve = None

    # ---- to be provided by each method ----------------------------------------------------------------------

    def setup_model(self) -> None:
        raise NotImplementedError

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """trainable_parameters() with their names (the optimizer's parameter groups are cut by name)."""
        raise NotImplementedError

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Everything that trains, by a stable name: what backups store and resume restores."""
        raise NotImplementedError

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def save_result(self, destination: str, output_format, dtype: torch.dtype | None,
                    train_config: dict | None) -> list:
        raise NotImplementedError

    def after_optimizer_step(self) -> None:
        """Hook for methods that must restore frozen parts of a partly-trained tensor (embeddings)."""

    # ---- shared --------------------------------------------------------------------------------------------

    def experts_in_training(self) -> list[str]:
        if not self.model.variant.has_two_experts:
            return ["transformer"]
        return {"high": ["transformer"], "low": ["transformer_2"], "both": ["transformer", "transformer_2"]}[
            self.config.expert]

    def apply_performance(self) -> None:
        """Checkpointing, block swap, activation offload, attention kernel and compilation of the trained
        experts (config.performance); call at the end of setup_model, once what trains is decided."""
        from modules.modelSetup.memory.PerformanceSetup import PerformanceSetup
        self.performance = {}
        if self.model.variant.takes_driving_video:
            from modules.model.animate_2_attention import use_training_attention
            use_training_attention(self.model.transformer)   # the in-context attention with a backward pass
        for name in self.experts_in_training():
            self.performance[name] = PerformanceSetup(
                getattr(self.model, name), self.config.performance, self.config.gradient_checkpointing, self.device,
                fine_tune=self.config.training_method.value == "FINE_TUNE").apply()

    def release_host_buffers(self) -> None:
        """Frees what the steps keep in host memory for the next step (activation offload's buffers), before a
        backup or the final save copies weights to the host; the next step makes them again."""
        for setup in getattr(self, "performance", {}).values():
            setup.release_host_buffers()

    def move_experts_to_device(self) -> None:
        """Moves the trained experts to the device (swapped blocks stay on the host) in training mode."""
        for name in self.experts_in_training():
            setup = getattr(self, "performance", {}).get(name)
            if setup is not None:
                setup.move_to_device()
            else:
                getattr(self.model, name).to(self.device)
            getattr(self.model, name).train()

    def training_step(self) -> contextlib.AbstractContextManager:
        """Held around a training step's forward and backward (a checkpointed block is recomputed in the
        backward, so what holds for the forward must hold there too): distill.mode preserve's accelerator."""
        return contextlib.nullcontext() if self.preserve is None else self.preserve.attached(self.model)

    def forward_and_teacher(self, transformer, forward, text: Tensor) -> tuple[Tensor, tuple | None]:
        """`forward(text)` under autocast, and with distill.mode preserve the preservation term's (trained,
        teacher) predictions (None otherwise)."""
        with self.autocast():
            predicted = forward(text)
        if self.preserve is None:
            return predicted, None
        with self.autocast():
            return predicted, self.preserve.preservation(transformer, forward, text, predicted)

    @staticmethod
    def preserved_pair(pair: tuple | None, references: int = 0) -> dict:
        """Prediction's `preserved` / `teacher` fields from forward_and_teacher's pair (VACE: without the
        reference frames)."""
        if pair is None:
            return {}
        return {"preserved": pair[0][:, :, references:].float(), "teacher": pair[1][:, :, references:].float()}

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.config.train_dtype.torch_dtype()
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _choose_expert_and_sigmas(self, generator: torch.Generator,
                                  item_generators: list[torch.Generator]) -> tuple[str, Tensor]:
        """The expert from the step's generator (every rank of a step routes alike), each item's sigma from its
        own generator."""
        timestep_config = self.config.timestep
        boundary = self.model.boundary_ratio
        low, high, include_high = 0.0, 1.0, True
        expert = "transformer"
        if boundary is not None and self.model.variant.has_two_experts:
            experts = self._step_experts()
            expert = self._route(generator) if len(experts) == 2 else experts[0]
            low, high, include_high = (boundary, 1.0, True) if expert == "transformer" else (0.0, boundary, False)
        return expert, torch.cat([sample_sigmas(timestep_config, 1, g, low=low, high=high, include_high=include_high)
                                  for g in item_generators])

    def _step_experts(self) -> list[str]:
        return [self.only_expert] if self.only_expert else self.experts_in_training()

    def _route(self, generator: torch.Generator) -> str:
        # route the step by a sigma drawn from the whole distribution, so each expert trains as often as the
        # schedule would use it
        sigma = sample_sigmas(self.config.timestep, 1, generator).item()
        return "transformer" if sigma >= self.model.boundary_ratio else "transformer_2"

    def step_expert(self, generator: torch.Generator) -> str:
        """The expert `predict` routes a step to, from a copy of the step's generator (the generator is left as it
        is): what predict draws before routing, then the routing draw."""
        experts = self._step_experts()
        if len(experts) == 1 or self.model.boundary_ratio is None:
            return experts[0]
        copy = torch.Generator().set_state(generator.get_state())
        torch.randint(0, 2 ** 62, (1,), generator=copy)   # item_generators' draw
        return self._route(copy)

    @staticmethod
    def item_generators(batch: dict, generator: torch.Generator, count: int) -> list[torch.Generator]:
        """One generator per item, seeded by the step's generator and the item's place in its global batch
        (`item_index`, from the data loader; 0..B-1 in one process): an item draws the same noise and sigma
        whether its global batch runs in one process or is dealt out to several ranks."""
        base = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        places = batch.get("item_index")
        places = range(count) if places is None else [int(p) for p in places]
        return [torch.Generator().manual_seed(derive_seed(base, 0, place, "item_noise")) for place in places]

    def text_embeddings(self, batch: dict) -> Tensor:
        if "text_embeds" in batch:
            return batch["text_embeds"].to(self.device, non_blocking=True)
        return self.model.encode_text(batch["prompt"])

    def _noise(self, x0: Tensor, generator: torch.Generator) -> Tensor:
        """Standard normal noise like x0, a function of the step's generator seed. On a GPU it is drawn there (no
        host-side draw and copy of a latent-sized tensor every step); on the CPU from the step's generator."""
        if self.device.type == "cpu":
            return torch.randn(x0.shape, generator=generator)
        device_generator = torch.Generator(self.device).manual_seed(generator.initial_seed())
        return torch.randn(x0.shape, generator=device_generator, device=self.device)

    def expert_for_sigma(self, sigma: float) -> str:
        """The expert that denoises at `sigma` (the high-noise one at and above the boundary, as in sampling)."""
        boundary = self.model.boundary_ratio
        if boundary is None or not self.model.variant.has_two_experts:
            return "transformer"
        return "transformer" if sigma >= boundary else "transformer_2"

    def predict(self, batch: dict, generator: torch.Generator, sigmas: Tensor | None = None) -> Prediction:
        """`sigmas`: fixed sigmas (B,) of one expert's range instead of drawn ones (the validation loss)."""
        model = self.model
        # batches arrive pinned on CUDA (WanBaseDataLoader.batches): the copies do not wait for the device
        x0 = model.normalize_latents(batch["latents"].to(self.device, non_blocking=True).float())
        item_generators = self.item_generators(batch, generator, x0.shape[0])
        if sigmas is None:
            expert, sigmas = self._choose_expert_and_sigmas(generator, item_generators)
        else:
            expert = self.expert_for_sigma(float(sigmas[0]))
        # (B, z, T, h, w) as B draws of (1, z, T, h, w), each from its item's generator
        noise = torch.cat([self._noise(x0[i:i + 1], g) for i, g in enumerate(item_generators)])
        sigmas = sigmas.to(self.device)
        s = sigmas.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        timestep = sigmas * NUM_TRAIN_TIMESTEPS
        loss_mask = batch.get("loss_mask")
        weights = mask_loss_weights(batch, self.config.loss, model.variant, tuple(x0.shape), self.device)
        if weights is not None:
            loss_mask = weights if loss_mask is None else loss_mask.to(self.device) * weights

        if model.expand_timesteps:
            # TI2V-5B: in image-to-video items the first latent frame is the clean image and its tokens get
            # timestep 0; it carries no loss
            clean_first = bool(batch.get("clean_first_frame", False))
            if clean_first:
                noisy = torch.cat([x0[:, :, :1], noisy[:, :, 1:]], dim=2)
                first_mask = torch.ones(1, 1, x0.shape[2], 1, 1, device=self.device)
                first_mask[:, :, 0] = 0
                loss_mask = first_mask if loss_mask is None else loss_mask * first_mask
            timestep = model.expanded_timesteps(timestep, tuple(x0.shape), clean_first)

        model_input = noisy
        if "condition" in batch and not model.variant.takes_driving_video:
            model_input = torch.cat([noisy, batch["condition"].to(self.device, noisy.dtype, non_blocking=True)], dim=1)
        image_embeds = batch.get("image_embeds")
        text = self.text_embeddings(batch)
        if image_embeds is not None and text.shape[1] != 512:
            # diffusers splits image from text tokens as "all but the last 512": anything else mixes them silently
            raise ValueError(f"text embeddings have {text.shape[1]} tokens; with image tokens they must be exactly 512")

        transformer = getattr(model, expert)
        vace, references = {}, 0
        if "vace_context" in batch:
            from modules.modelSetup.vace_inputs import control_kwargs, with_references
            model_input, context, references = with_references(batch["vace_context"], model_input, sigmas,
                                                               item_generators, self.device)
            vace = control_kwargs(transformer, context)
        if image_embeds is not None and transformer.config.get("pos_embed_seq_len"):
            # FLF2V: diffusers' image embedder takes (2B, tokens, dim), first and last image of each sample in turn,
            # and views it as (B, 2*tokens, dim) to add its position embedding
            image_embeds = image_embeds.reshape(-1, transformer.config.pos_embed_seq_len // 2, image_embeds.shape[-1])
        if model.variant.takes_driving_video:
            from modules.modelSetup.animate_2_inputs import animate_2_prediction
            predicted, pair = self.forward_and_teacher(transformer, lambda text: animate_2_prediction(
                transformer, batch, noisy, timestep, text, self.device, model.vae_spatial_stride), text)
            return Prediction(predicted=predicted.float(), target=noise - x0, x0=x0, noisy=noisy, sigmas=sigmas,
                              expert=expert, loss_mask=loss_mask, **self.preserved_pair(pair))
        predicted, pair = self.forward_and_teacher(transformer, lambda text: transformer(
            hidden_states=model_input, timestep=timestep, encoder_hidden_states=text,
            encoder_hidden_states_image=None if image_embeds is None
            else image_embeds.to(self.device, non_blocking=True),
            **transformer_condition(batch, self.device), **vace, return_dict=False)[0], text)
        predicted = predicted[:, :, references:]   # VACE: the reference frames are condition, not target
        return Prediction(predicted=predicted.float(), target=noise - x0, x0=x0, noisy=noisy, sigmas=sigmas,
                          expert=expert, loss_mask=loss_mask, **self.preserved_pair(pair, references))

    def loss_bearing_elements(self, batch: dict, prediction: Prediction) -> Tensor:
        """How many elements of the batch's loss carry weight, left on the device: 0 when the loss mask is 0
        everywhere (loss masks, Animate's reference and continuation frames) or every item's concept weighs 0. Such a
        batch trains nothing, whatever its loss reads."""
        predicted = prediction.predicted
        if prediction.loss_mask is None:
            per_sample = torch.full((predicted.shape[0],), predicted[0].numel(), device=predicted.device)
        else:
            per_sample = (prediction.loss_mask > 0).expand(predicted.shape).flatten(1).sum(1)
        weights = batch.get("loss_weight")
        if weights is not None:
            per_sample = per_sample * (weights.to(per_sample.device) > 0)
        return per_sample.sum()

    def calculate_loss(self, batch: dict, prediction: Prediction) -> Tensor:
        loss = self._weighted_mse(batch, prediction, prediction.target)
        if prediction.teacher is not None:   # distill.mode preserve: teacher matching
            loss = loss + self.preserve.weight * self._weighted_mse(batch, prediction, prediction.teacher,
                                                                    prediction.preserved)
        return loss

    @staticmethod
    def _weighted_mse(batch: dict, prediction: Prediction, target: Tensor, predicted: Tensor | None = None) -> Tensor:
        error = ((prediction.predicted if predicted is None else predicted) - target) ** 2
        if prediction.loss_mask is not None:
            mask = prediction.loss_mask.to(error.dtype).expand_as(error)
            # the weighted mean over the mask's weight; an item weighted 0 everywhere adds 0
            per_sample = (error * mask).flatten(1).sum(1) / mask.flatten(1).sum(1).clamp_min(1e-12)
        else:
            per_sample = error.flatten(1).mean(1)
        weights = batch.get("loss_weight")
        if weights is not None:
            per_sample = per_sample * weights.to(per_sample.device, per_sample.dtype)
        return per_sample.mean()

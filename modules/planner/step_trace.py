"""One training step, traced with a StorageCounter: the run's transformer at its real size, set up by the run's own
setup class (LoRA / DoRA / fine-tune adapters, dtypes, fp8 storage, checkpointing, block swap, activation offload),
its optimizer, EMA, and two optimizer steps (the second holds the optimizer state through its forward pass, as
every later step does).

`fake=True` (the planner): weights and activations are fake tensors, nothing is computed and no memory is spent.
The CPU stands for the device: it is the one device every build has, and on a CPU-only build PyTorch's fake
`cuda` tensors cannot carry an autograd graph (each autograd node asks the CUDA device guard for a stream). What
the GPU does differently is the kernel choice, not the tensors: the fused AdamW CUDA uses is taken here too, and
the attention kernels save the same output and log-sum-exp on both. Host memory (a block swap's weights, the
offloaded activations) is told apart by the counter (`StorageCounter.host`).

`fake=False`: the same step on real tensors on the CPU, counted by the same counter (the tests' reference).
"""
from __future__ import annotations

import contextlib
import copy
import math
from unittest import mock

import torch

from modules.benchmark.architectures import TEXT_SEQUENCE_LENGTH, Architecture, make_wan_model
from modules.planner.plan_shapes import PlanError, PlanShape
from modules.planner.StorageCounter import StorageCounter, following_resizes
from modules.util.config.TrainConfig import TrainConfig

DEVICE = torch.device("cpu")
IMAGE_TOKENS = 257   # CLIP ViT-H/14 tokens per image (Wan 2.1 I2V / FLF2V image embeddings)
VACE_REFERENCES = 1  # reference images a VACE step is planned with


def _skeleton(arch: Architecture):
    """The transformer with meta parameters; built outside the fake mode, where its initialisers cost nothing."""
    from modules.model.transformer_classes import transformer_class
    from modules.util.empty_weights import empty_weights

    # the planner's architectures name no class: VACE's by its vace_layers, the others' by their variant
    name = "WanVACETransformer3DModel" if "vace_layers" in arch.transformer else arch.variant.transformer_class_name
    with empty_weights():
        return transformer_class({"_class_name": name})(**arch.transformer)


def _build_transformer(transformer, dtype: torch.dtype, seed: int, fake: bool):
    generator = torch.Generator().manual_seed(seed)
    for module in transformer.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            data = torch.empty(parameter.shape, dtype=dtype, device=DEVICE)
            if not fake:  # the reference run computes: a small random init keeps it finite
                data.normal_(0.0, 1.0 / math.sqrt(max(1, parameter.shape[-1])), generator=generator)
            module._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
    return transformer


def _build_expert(skeleton, dtype: torch.dtype, fp8: bool, seed: int, fake: bool, meta: bool = False):
    if meta:   # its shape only (nothing allocated): an expert that is not trained
        return skeleton
    transformer = _build_transformer(skeleton, dtype, seed, fake)
    if fp8:
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    return transformer


def _weight_dtype(config: TrainConfig) -> tuple[torch.dtype, bool]:
    """(the dtype the transformer is built in, whether it is then held in float8)."""
    from modules.util.enum.DataType import DataType
    weight = config.model.transformer.weight_dtype
    if weight is DataType.FLOAT_8:
        return torch.bfloat16, True
    if weight.is_quantized:
        raise PlanError(f"model.transformer.weight_dtype {weight.value}: bitsandbytes-quantized weights are not "
                        f"planned (their kernels have no fake implementation); plan with FLOAT_8 for an estimate")
    return weight.torch_dtype(), False


def _planning_config(config: TrainConfig) -> TrainConfig:
    """The run's config as the trace uses it: nothing read from disk (an adapter to start from, compilation)."""
    config = copy.deepcopy(config)
    config.lora.init_from = ""
    config.performance.compile_blocks = False   # compiled blocks hold the same tensors; compiling fake ones is slow
    return config


def _optimizer(config: TrainConfig, groups: list[dict], fake: bool):
    """The run's optimizer, or for bitsandbytes' 8-bit ones (CUDA kernels, no fake implementation) an optimizer
    holding the same state tensors (modules/planner/StateShapedOptimizer.py)."""
    name = config.optimizer.optimizer
    if name == "ADAMW":
        # CUDA runs the fused kernel (create_optimizer): no per-step temporaries; the CPU has one too
        return torch.optim.AdamW(groups, lr=config.optimizer.learning_rate, betas=config.optimizer.betas,
                                 eps=config.optimizer.eps, weight_decay=config.optimizer.weight_decay, fused=True)
    if name in ("ADAMW_8BIT", "LION_8BIT", "PRODIGY") and fake:
        from modules.planner.StateShapedOptimizer import StateShapedOptimizer
        return StateShapedOptimizer(groups, name)
    from modules.trainer.optimizers import create_optimizer
    return create_optimizer(config.optimizer, groups)


def _batch(arch: Architecture, shape: PlanShape, counter: StorageCounter, fake: bool, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    z, frames, height, width = arch.latent_shape(shape.frames, shape.height, shape.width)
    b = shape.batch_size

    def draw(*size, dtype=torch.float32):
        tensor = torch.empty(size, dtype=dtype)
        return tensor if fake else tensor.normal_(generator=generator)

    with counter.host():   # batches arrive in (pinned) host memory and are copied in by predict
        batch = {"latents": draw(b, z, frames, height, width, dtype=torch.bfloat16),
                 "text_embeds": draw(b, TEXT_SEQUENCE_LENGTH, arch.text_dim, dtype=torch.bfloat16),
                 "loss_weight": torch.ones(b)}
        if arch.variant.takes_driving_video:
            return _animate_2_batch(batch, arch, shape, draw)
        if arch.transformer["in_channels"] > z:
            # I2V / FLF2V: the mask (4 channels) and the image latents (z) concatenated to the noisy latents;
            # Wan-Fun Control: its control and start-image (or inpaint) channels
            batch["condition"] = draw(b, arch.transformer["in_channels"] - z, frames, height, width,
                                      dtype=torch.bfloat16)
        if arch.transformer.get("vace_layers"):
            # VACE: the control context of one reference image (one more latent frame than the video)
            batch["vace_context"] = draw(b, arch.transformer["vace_in_channels"], VACE_REFERENCES + frames, height,
                                         width)
        if arch.transformer.get("image_dim"):
            images = 2 if arch.transformer.get("pos_embed_seq_len") else 1
            batch["image_embeds"] = draw(b * images, IMAGE_TOKENS, arch.transformer["image_dim"],
                                         dtype=torch.bfloat16)
        if arch.variant.takes_pose_video:
            # Animate (EncodeAnimate's items): the reference latent frame before the clip's, the pose latents of
            # the clip's frames, its face crops in pixels at the motion encoder's size
            batch["latents"] = draw(b, z, frames + 1, height, width, dtype=torch.bfloat16)
            batch["condition"] = draw(b, z + 4, frames + 1, height, width, dtype=torch.bfloat16)
            batch["pose_latents"] = draw(b, z, frames, height, width, dtype=torch.bfloat16)
            side = arch.transformer.get("motion_encoder_size", 512)
            batch["face_pixels"] = draw(b, 3, shape.frames, side, side)
    return batch


def _animate_2_batch(batch: dict, arch: Architecture, shape: PlanShape, draw) -> dict:
    """EncodeAnimate2's items: the reference slot before the clip's latents, its condition, the driving video's
    latents, the CLIP tokens of the reference and of the driving video's first frame, the reference prompt."""
    z, frames, height, width = arch.latent_shape(shape.frames, shape.height, shape.width)
    b = shape.batch_size
    batch["latents"] = draw(b, z, frames + 1, height, width, dtype=torch.bfloat16)
    batch["condition"] = draw(b, z + 4, frames + 1, height, width, dtype=torch.bfloat16)
    batch["driving_latents"] = draw(b, z, frames, height, width, dtype=torch.bfloat16)
    for name in ("image_embeds", "driving_image_embeds"):
        batch[name] = draw(b, IMAGE_TOKENS, 1280, dtype=torch.bfloat16)   # MLPProj(1280, dim)
    batch["reference_text_embeds"] = draw(b, TEXT_SEQUENCE_LENGTH, arch.text_dim, dtype=torch.bfloat16)
    return batch


def _predict_fake(setup, batch: dict, expert: str):
    """BaseWanSetup.predict's tensors without its host-side random draws (a fake tensor has no value to seed a
    generator or route an expert with): the same inputs, timesteps, forward pass and loss."""
    from modules.model.animate_condition import transformer_condition
    model = setup.model
    x0 = model.normalize_latents(batch["latents"].to(DEVICE).float())
    noise = torch.randn(x0.shape)
    sigmas = torch.rand(x0.shape[0])
    s = sigmas.view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    timestep = sigmas * 1000
    if model.expand_timesteps:
        timestep = model.expanded_timesteps(timestep, tuple(x0.shape), False)
    transformer = getattr(model, expert)
    if model.variant.takes_driving_video:   # Animate-2: the extract pass, then the cached pass
        from modules.modelSetup.BaseWanSetup import Prediction
        from modules.modelSetup.animate_2_inputs import animate_2_prediction
        predicted, pair = setup.forward_and_teacher(transformer, lambda text: animate_2_prediction(
            transformer, batch, noisy, timestep, text, DEVICE, model.vae_spatial_stride),
            batch["text_embeds"].to(DEVICE))
        return Prediction(predicted=predicted.float(), target=noise - x0, x0=x0, noisy=noisy, sigmas=sigmas,
                          expert=expert, **setup.preserved_pair(pair))
    model_input = noisy
    if "condition" in batch:
        model_input = torch.cat([noisy, batch["condition"].to(DEVICE, noisy.dtype)], dim=1)
    image_embeds = batch.get("image_embeds")
    if image_embeds is not None and transformer.config.pos_embed_seq_len:
        image_embeds = image_embeds.reshape(-1, transformer.config.pos_embed_seq_len // 2, image_embeds.shape[-1])
    vace, references = {}, 0
    if "vace_context" in batch:   # as vace_inputs.with_references: noised reference frames before the video
        from modules.modelSetup.vace_inputs import control_kwargs
        context = batch["vace_context"].to(DEVICE)
        references = context.shape[2] - noisy.shape[2]
        model_input = torch.cat([torch.randn(*noisy.shape[:2], references, *noisy.shape[3:]), model_input], dim=2)
        vace = control_kwargs(transformer, context)
    predicted, pair = setup.forward_and_teacher(transformer, lambda text: transformer(
        hidden_states=model_input, timestep=timestep, encoder_hidden_states=text,
        encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(DEVICE),
        **transformer_condition(batch, DEVICE), **vace, return_dict=False)[0], batch["text_embeds"].to(DEVICE))
    predicted = predicted[:, :, references:]
    from modules.modelSetup.BaseWanSetup import Prediction
    return Prediction(predicted=predicted.float(), target=noise - x0, x0=x0, noisy=noisy, sigmas=sigmas,
                      expert=expert, **setup.preserved_pair(pair, references))


def trace_step(config: TrainConfig, arch: Architecture, shape: PlanShape, fake: bool = True,
               steps: int = 1, place=None, detail: bool = False,
               setup_only: bool = False, sections: list[str] | None = None) -> tuple[StorageCounter, dict]:
    """Runs `steps` optimizer steps of the run under a StorageCounter, after an optimizer step on zero gradients
    that creates the optimizer's state (so the traced step is a later step: its forward pass holds that state);
    returns the counter and facts about the setup. `place(setup, model)`: puts the trained experts on the device
    instead of setup.move_experts_to_device() (a real multi-process run's layout: ParallelLayout.wrap). `detail`:
    each storage also names the module it was made in (ModulePlaces; slower). `setup_only`: stops before the first
    traced step, so the counter's peak is what the step starts with (weights, adapters, optimizer state, inputs): a
    floor under the step's peak, in a fraction of a step's trace. `sections`: a name per block; each block's backward
    pass keeps its own peak under that name (StorageCounter.set_section; composed_trace.py)."""
    import modules.modelSetup.WanEmbeddingSetup  # noqa: F401  (registers)
    import modules.modelSetup.WanFineTuneSetup  # noqa: F401
    import modules.modelSetup.WanLoRASetup  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    from modules.trainer.distributed import gradient_norm
    from modules.trainer.optimizers import EMA
    from modules.trainer.parameter_groups import parameter_groups
    from modules.util.registry import lookup

    import warnings
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # ActivationOffload
    config = _planning_config(config)
    if config.training_method.value == "EMBEDDING":
        raise PlanError("training_method EMBEDDING: the planner covers LoRA and fine-tunes (an embedding run holds the "
                        "text encoder, not a trained transformer)")
    dtype, fp8 = _weight_dtype(config)
    from modules.planner.ModulePlaces import ModulePlaces
    places = ModulePlaces() if detail else None
    counter = StorageCounter(DEVICE.type, places)
    facts: dict = {}
    two = arch.variant.has_two_experts
    skeletons = [_skeleton(arch) for _ in range(2 if two else 1)]
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    resizes = contextlib.nullcontext() if fake else following_resizes(counter)
    # Animate-2's model reads its token grids ((B, 3) integer tensors) back as numbers, also when the backward pass
    # recomputes a block: fake tensors that small keep their values (by default only one-element ones do)
    grids = mock.patch("torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT", 3 * shape.batch_size) \
        if fake and arch.variant.takes_driving_video else contextlib.nullcontext()
    with mode, counter, resizes, grids, _set_data_when_swap_fails(fake):
        counter.set_phase("weights")
        # an expert that does not train stays on the host (GenericTrainer moves only the trained ones)
        trained = {"high": ["transformer"], "low": ["transformer_2"],
                   "both": ["transformer", "transformer_2"]}[config.expert] if two else ["transformer"]
        model = make_wan_model(arch, _build_expert(skeletons[0], dtype, fp8, config.seed, fake,
                                                   meta="transformer" not in trained))
        if two:
            model.transformer_2 = _build_expert(skeletons[1], dtype, fp8, config.seed + 1, fake,
                                                meta="transformer_2" not in trained)
        transformer = model.transformer_2 if arch.variant.has_two_experts and config.expert == "low" \
            else model.transformer
        setup = lookup("model_setup", config.model_type, config.training_method)(config, model)
        setup.device = DEVICE
        try:
            setup.setup_model()
        except ValueError as error:
            raise PlanError(str(error)) from None
        (place or (lambda s, _m: s.move_experts_to_device()))(setup, model)
        if config.distill.mode == "preserve":   # the frozen accelerator and the teacher pass, at their real shapes
            from modules.planner.preserve_plan import planned_preserve
            setup.preserve = planned_preserve(config, model, setup.experts_in_training(), DEVICE)
        if fake:
            for expert in setup.experts_in_training():
                for module in getattr(model, expert).modules():
                    if hasattr(module, "module_dropout"):
                        # peft's LoHa / LoKr draw a host-side random number to drop the whole adapter in training
                        # (`torch.rand(1) > module_dropout`), which has no value on fake tensors; as in eval they run
                        module.training = False
        parameters = setup.trainable_parameters()
        counter.track([p for p in parameters], "trainable")
        performance = setup.performance
        for expert_setup in performance.values():
            if expert_setup.block_swap is not None:
                counter.move_to_host([host for pairs in expert_setup.block_swap.host.values() for _, host in pairs])
            if expert_setup.offload is not None:
                _count_offload_as_host(expert_setup.offload, counter)
        facts["parameters"] = sum(p.numel() for p in transformer.parameters())
        facts["trainable_parameters"] = sum(p.numel() for p in parameters)
        facts["features"] = "; ".join(s.describe() for s in performance.values())
        if setup.preserve is not None:
            from modules.planner.preserve_plan import describe
            facts["distill"] = describe(config)
        counter.set_phase("optimizer_setup")
        optimizer = _optimizer(config, parameter_groups(config, setup.named_trainable_parameters()), fake)
        counter.set_phase("ema")
        ema = EMA(parameters, config.optimizer.ema_decay) if config.optimizer.ema else None
        counter.set_phase("optimizer")
        for parameter in parameters:
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counter.retag_live("optimizer", "optimizer_state")
        counter.set_phase("inputs")
        batch = _batch(arch, shape, counter, fake, config.seed)
        frozen = [p for e in setup.experts_in_training() for p in getattr(model, e).parameters()
                  if not p.requires_grad]
        counter.reset_peak()
        if setup_only:
            return counter, facts
        experts = setup.experts_in_training()
        if places is not None:
            for expert in experts:
                places.name_modules(getattr(model, expert), f"{expert}." if len(experts) > 1 else "")
        if sections is not None:
            for expert in experts:
                _mark_backward(getattr(model, expert).blocks, sections, counter)
        for step in range(steps):
            watching = places.watching() if places is not None else contextlib.nullcontext()
            with setup.training_step(), watching:   # as the trainer's step: forward and backward
                counter.set_phase("forward")
                expert = experts[step % len(experts)]
                if fake:
                    prediction = _predict_fake(setup, batch, expert)
                else:
                    prediction = setup.predict(batch, torch.Generator().manual_seed(config.seed + step))
                loss = setup.calculate_loss(batch, prediction)
                del prediction
                # fp8 layerwise casting stores a new float8 tensor in each layer after it runs: weights, not activations
                counter.retag(frozen, "weights")
                counter.retag_live("forward", "activations")
                counter.set_phase("backward")
                loss.backward()
                del loss
            counter.retag([p.grad for p in parameters if p.grad is not None], "grads")
            counter.retag_live("backward", "transient")
            counter.set_phase("optimizer")
            gradient_norm(parameters, config.optimizer.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            setup.after_optimizer_step()
            if ema is not None:
                ema.update()
            counter.retag_live("optimizer", "optimizer_state")
            counter.retag(frozen, "weights")
        preview = preview_shape(config, arch)
        if preview is not None and fake:
            # a preview runs between steps: the training state stays, the sampler's forward passes come on top
            previews = StorageCounter(DEVICE.type)
            with counter.peak_kept(), previews, torch.no_grad():
                _predict_fake(setup, _batch(arch, preview, previews, fake, config.seed), experts[0])
            facts["preview"] = (preview, counter.total + previews.peak)
        facts["host_weights"] = sum(s.block_swap is not None and sum(
            host.nbytes for pairs in s.block_swap.host.values() for _, host in pairs) or 0
            for s in performance.values())
        del optimizer, ema, batch, setup, model, transformer, parameters, performance
    return counter, facts


def _mark_backward(blocks, sections: list[str], counter: StorageCounter) -> None:
    """When the gradient reaches a block's output, that block's backward pass begins: its section starts."""
    from torch.utils._pytree import tree_leaves

    def start(section: str):
        return lambda _grad: counter.set_section(section)

    def hook(_module, _args, output, section: str):
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(start(section))
                return

    for block, section in zip(blocks, sections, strict=True):
        block.register_forward_hook(lambda m, a, o, section=section: hook(m, a, o, section))


@contextlib.contextmanager
def _set_data_when_swap_fails(fake: bool):
    """`Module.to` on a fake parameter swaps tensors (`torch.utils.swap_tensors`), which refuses a tensor the fake
    mode holds a weak reference to; setting `.data` instead gives the parameter the same new tensor (this happens
    while adapters are added, before an optimizer holds any parameter)."""
    if not fake:
        yield
        return
    swap = torch.utils.swap_tensors

    def swap_or_set_data(first, second):
        try:
            swap(first, second)
        except RuntimeError:   # refused before swapping anything (a weak reference, or a use count)
            first.data = second.data

    with mock.patch.object(torch.utils, "swap_tensors", swap_or_set_data):
        yield


def preview_shape(config: TrainConfig, arch: Architecture) -> PlanShape | None:
    """The largest enabled preview of sampling.samples_file (rounded as the sampler rounds), or None."""
    if not config.sampling.samples_file:
        return None
    from modules.util.sample_definitions import SampleDefinitionError, load_sample_definitions
    try:
        samples = [s for s in load_sample_definitions(config.sampling.samples_file) if s.enabled]
    except SampleDefinitionError:
        return None   # the run's own checks name the file; the training step is still planned
    unit, stride = arch.spatial_unit, arch.vae_temporal_stride
    shapes = [PlanShape(1, (s.frames - 1) // stride * stride + 1, max(unit, s.height // unit * unit),
                        max(unit, s.width // unit * unit)) for s in samples]
    return max(shapes, key=lambda s: s.frames * s.height * s.width, default=None)


def _count_offload_as_host(offload, counter: StorageCounter) -> None:
    """The offloaded copies are host memory (on the CPU standing for the device they would count as its own)."""
    offload_one = offload._offload

    def offload_to_host(tensor):
        with counter.host():
            return offload_one(tensor)

    offload._offload = offload_to_host

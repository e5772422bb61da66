"""Host memory (RAM) of the whole training process, planned per phase beside the device's peak (memory_plan.py).

The process holds different parts in host memory as it goes (GenericTrainer): every part is read into host memory
(load: the transformer cast tensor by tensor as read, so one tensor in float32 is in flight), caching moves one
encoder at a time to the device while the others wait on the host (the transformer waits for the whole of
caching), the text pass runs first and the text encoder is released before the VAE pass (the previews' prompt
embeddings kept; Animate-2's previews read it again; an embedding run keeps it, distill.mode preserve releases it
after caching), the transformer moves to the device except its swapped blocks, a backup copies the trainable weights and the
optimizer state to the host, and the final save converts the trained weights to the output dtype.

Each phase is a sum of parts (bytes); the run's host peak is the largest phase. Sizes come from the parts' own
configs (built on the meta device: no weights), the weight dtypes of the config and the device plan of the
training step (its block swap weights and offloaded activations, `Prediction.host_pinned_bytes`).

Pinned host memory: block swap keeps its swapped blocks in one page-locked arena of their exact size (each tensor
aligned to 64 bytes) and activation offload its block inputs in exact-size page-locked buffers reused every step
and kept after, but for a backup or the final save, which free them first (modules/util/pinned_arena.py), so both
count their bytes. The page-locked batches still come from
PyTorch's caching host allocator, which rounds every allocation up to a power of two (`pinned_bytes`). On a CPU
device nothing is pinned and the training step's whole trace (weights, adapters, optimizer state, activations)
lives in host memory.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.config.TrainConfig import TrainConfig

GIB = 1024 ** 3
MIB = 1024 ** 2
ENCODERS = Path(__file__).resolve().parents[2] / "resources" / "wan_configs" / "encoders"

# The process before any part loads: the interpreter with torch, diffusers and transformers imported (measured at
# about 0.6 GiB RSS), and on a CUDA machine the host side of the CUDA context (the driver and the kernels of
# cuBLAS / cuDNN mapped and touched: about 1.5 GiB). Not in the per-phase growth the tests compare.
PROCESS_BYTES = 640 * MIB
CUDA_HOST_BYTES = 1536 * MIB

PHASES = ("load", "caching: text encoding", "caching: VAE / image encoding", "training step", "preview", "backup",
          "final save")
PROCESS = "process (interpreter, libraries)"


@dataclass
class HostPlan:
    """phase -> part -> bytes, the process included in every phase. `mapped`: phase -> the parts there that are
    pages of their files' memory mappings (mapped_parts.py): resident, in the total, but not anonymous memory."""
    phases: dict[str, dict[str, int]]
    cuda: bool
    notes: list[str] = field(default_factory=list)
    mapped: dict[str, set[str]] = field(default_factory=dict)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def growth(self, phase: str) -> int:
        """The phase's bytes above the process alone (what a measurement compares against RSS at start)."""
        return self.total(phase) - self.phases[phase].get(PROCESS, 0)

    def mapped_bytes(self, phase: str) -> int:
        return sum(self.phases[phase][name] for name in self.mapped.get(phase, ()))

    def anonymous_growth(self, phase: str) -> int:
        """The growth without the parts mapped from their files: what the process allocates (its RssAnon)."""
        return self.growth(phase) - self.mapped_bytes(phase)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, ram_gib: float) -> bool:
        return self.peak_bytes <= ram_gib * GIB

    def over(self, ram_gib: float) -> list[str]:
        """The phases that do not fit `ram_gib`, largest first."""
        return sorted((p for p in self.phases if self.total(p) > ram_gib * GIB), key=self.total, reverse=True)

    def line(self) -> str:
        return f"predicted host RAM peak: {self.peak_gib:.1f} GiB (phase {self.peak_phase})"

    def largest_parts(self, phase: str, count: int = 3) -> str:
        parts = sorted(self.phases[phase].items(), key=lambda item: item[1], reverse=True)[:count]
        return ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in parts)

    def detail(self) -> str:
        lines = ["host RAM per phase (GiB; the process included in each):"]
        for phase, parts in self.phases.items():
            mark = "  <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {phase:<32}{self.total(phase) / GIB:8.2f}{mark}")
            for name, size in sorted(parts.items(), key=lambda item: item[1], reverse=True):
                if size:
                    shown = f"{name} (mapped from its file)" if name in self.mapped.get(phase, ()) else name
                    lines.append(f"    {shown:<46}{size / GIB:8.2f}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"peak_gib": self.peak_gib, "peak_phase": self.peak_phase, "cuda": self.cuda,
                "phases": {phase: dict(parts) for phase, parts in self.phases.items()},
                "mapped": {phase: sorted(names) for phase, names in self.mapped.items() if names}}


def pinned_bytes(nbytes: int) -> int:
    """What PyTorch's caching host allocator takes for a pinned tensor of `nbytes`: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _dtype_bytes(dtype) -> int:
    value = getattr(dtype, "value", str(dtype))
    return {"FLOAT_32": 4, "FLOAT_16": 2, "BFLOAT_16": 2, "FLOAT_8": 1, "NFLOAT_4": 1}.get(value, 4)


@functools.lru_cache(maxsize=32)
def _numel(kind: str, config_json: str) -> int:
    """Parameters (and persistent buffers) of a part built from its config on the meta device."""
    from modules.util.empty_weights import empty_weights
    config = json.loads(config_json)
    with empty_weights():
        if kind == "text_encoder":
            from transformers import UMT5Config, UMT5EncoderModel
            module = UMT5EncoderModel(UMT5Config(**config))
        elif kind == "image_encoder":
            from transformers import CLIPVisionConfig, CLIPVisionModel
            module = CLIPVisionModel(CLIPVisionConfig(**config))
        else:
            from diffusers import AutoencoderKLWan
            module = AutoencoderKLWan(**{k: v for k, v in config.items() if not k.startswith("_")})
    names = dict(module.named_parameters())
    if "shared.weight" in names:   # UMT5's token embedding is one tensor under two names once loaded (tied)
        names.pop("encoder.embed_tokens.weight", None)
    return sum(p.numel() for p in names.values())


def _part_config(config: TrainConfig, part: str, shipped: str | None) -> dict | None:
    """A part's config.json: the base folder's own, else the released one (None: no such part)."""
    own = Path(config.model.base_model_name or "") / part / "config.json"
    if own.is_file():
        return json.loads(own.read_text(encoding="utf-8"))
    return json.loads((ENCODERS / shipped).read_text(encoding="utf-8")) if shipped else None


def _transformer_numels(arch) -> tuple[int, list[list[int]]]:
    """(every parameter of one expert, per block the parameters' sizes)."""
    return _skeleton_numels(arch.variant, json.dumps(arch.transformer, sort_keys=True, default=list))


@functools.lru_cache(maxsize=16)
def _skeleton_numels(variant, transformer_json: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    from modules.benchmark.architectures import Architecture
    from modules.planner.step_trace import _skeleton
    transformer = {k: (tuple(v) if isinstance(v, list) else v) for k, v in json.loads(transformer_json).items()}
    skeleton = _skeleton(Architecture("", "", variant, transformer, 16, 8))
    blocks = tuple(tuple(p.numel() for p in block.parameters()) for block in skeleton.blocks)
    return sum(p.numel() for p in skeleton.parameters()), blocks


def part_bytes(config: TrainConfig, arch) -> dict[str, int]:
    """Each part's weights in host memory, in the dtypes the config loads them in."""
    model = config.model
    total, _blocks = _transformer_numels(arch)
    parts = {"transformer": total * _dtype_bytes(model.transformer.weight_dtype)}
    if arch.variant.has_two_experts:
        parts["transformer_2"] = total * _dtype_bytes(model.transformer_2.weight_dtype)
    text = _part_config(config, "text_encoder", "umt5-xxl.json")
    parts["text encoder"] = _numel("text_encoder", json.dumps(text, sort_keys=True)) * \
        _dtype_bytes(model.text_encoder.weight_dtype)
    vae = arch.extra.get("vae") or _part_config(config, "vae", None)
    if vae:
        parts["VAE"] = _numel("vae", json.dumps(vae, sort_keys=True)) * _dtype_bytes(model.vae.weight_dtype)
    if arch.transformer.get("image_dim"):
        image = _part_config(config, "image_encoder", "clip-vit-h-14.json")
        parts["image encoder"] = _numel("image_encoder", json.dumps(image, sort_keys=True)) * \
            _dtype_bytes(model.image_encoder.weight_dtype)
    return parts


def _swapped_block_bytes(config: TrainConfig, arch) -> tuple[int, int]:
    """(bytes as tensors, bytes of block swap's arena: each tensor aligned) of the swapped blocks' weights."""
    from modules.util.pinned_arena import ALIGNMENT
    count = min(config.performance.block_swap, arch.transformer["num_layers"])
    if not count:
        return 0, 0
    _total, blocks = _transformer_numels(arch)
    size = _dtype_bytes(config.model.transformer.weight_dtype)
    exact = sum(n * size for block in blocks[-count:] for n in block)
    arena = sum(-(-n * size // ALIGNMENT) * ALIGNMENT for block in blocks[-count:] for n in block)
    return exact, arena


def _media_bytes(config: TrainConfig, shape) -> int:
    """Decoded clips in flight while caching: the pipeline's prefetch (2 per thread, at least 1) of the largest
    bucket, each as uint8 frames and as the float32 tensor the encoder reads."""
    in_flight = max(1, 2 * config.data.dataloader_threads)
    return in_flight * shape.frames * shape.height * shape.width * 3 * (1 + 4)


def _kept_prompt_bytes(config: TrainConfig) -> int:
    """The previews' prompt and negative prompt embeddings (512 x d_model each, in the encoder's dtype)."""
    from modules.util.sample_definitions import SampleDefinitionError, load_sample_definitions
    try:
        count = sum(1 for sample in load_sample_definitions(config.sampling.samples_file) if sample.enabled)
    except (OSError, SampleDefinitionError):   # judged with the config; the plan does not repeat that error
        count = 0
    text = _part_config(config, "text_encoder", "umt5-xxl.json")
    return 2 * count * 512 * text["d_model"] * _dtype_bytes(config.model.text_encoder.weight_dtype)


def plan_host(config: TrainConfig, prediction=None, arch=None, shape=None, cuda: bool | None = None) -> HostPlan:
    """The run's host memory per phase. `prediction`: the device plan of the step (memory_plan.predict), which gives
    the pinned swap / offload bytes and, on a CPU device, the step's whole trace; without it the step's device
    share is left out. `cuda`: whether the run's device is a CUDA card (default: unless config.device is cpu)."""
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    arch = arch or resolve_architecture(config)
    shape = shape or largest_shape(config, arch)
    cuda = (config.device or "auto").split(":")[0] not in ("cpu", "mps") if cuda is None else cuda
    parts = part_bytes(config, arch)
    base = {PROCESS: PROCESS_BYTES + (CUDA_HOST_BYTES if cuda else 0)}
    notes = []
    transformers = {k: v for k, v in parts.items() if k.startswith("transformer")}
    encoders = {k: v for k, v in parts.items() if not k.startswith("transformer")}
    _total, blocks = _transformer_numels(arch)
    phases: dict[str, dict[str, int]] = {}
    phases["load"] = {**base, **parts}
    if config.model.transformer.weight_dtype.value == "FLOAT_8":
        # float8 from a full-precision file goes through float32 tensor by tensor (test_host_memory.py)
        phases["load"]["one tensor cast as read (float32)"] = max((n for b in blocks for n in b), default=0) * 4

    on_device_text = ("text encoder",) if cuda else ()
    phases["caching: text encoding"] = {**base, **{k: v for k, v in parts.items() if k not in on_device_text}}
    if not cuda:   # the encoder's activations are in host memory too
        phases["caching: text encoding"]["text encoder activations"] = _text_activation_bytes(config)
    media = _media_bytes(config, shape)
    # the text pass runs first; a training run then releases the text encoder unless it needs it later
    from modules.model.released_parts import released_before_vae_pass
    not_here = ("VAE", "image encoder") if cuda else ()
    not_here += ("text encoder",) if released_before_vae_pass(config) else ()
    phases["caching: VAE / image encoding"] = {**base, **{k: v for k, v in parts.items() if k not in not_here},
                                               "decoded clips in flight": media}
    if released_before_vae_pass(config) and config.sampling.samples_file and not arch.variant.takes_driving_video:
        phases["caching: VAE / image encoding"]["kept prompt embeddings"] = _kept_prompt_bytes(config)

    # training: the trained expert(s) on the device but for the swapped blocks; an expert not trained stays here
    kept_encoders = {k: v for k, v in encoders.items() if k != "text encoder"}
    if config.training_method.value == "EMBEDDING":
        kept_encoders["text encoder"] = 0 if cuda else parts["text encoder"]
    trained = _trained_experts(config, arch)
    idle = {k: v for k, v in transformers.items() if k not in trained}
    steady = {**base, **kept_encoders, **{f"{k} (not trained)": v for k, v in idle.items()}}
    step = dict(steady)
    state = 0
    if prediction is not None:
        state = prediction.parts.get("trainable + grads + optimizer", 0)
    if cuda:
        exact, arena = _swapped_block_bytes(config, arch)
        step["swapped blocks (pinned)"] = arena
        if prediction is not None and _offloaded_inputs(config, arch):
            # exact-size buffers, kept for the next step (and so through previews; freed for backups and the save)
            step["offloaded block inputs (pinned, kept)"] = max(0, prediction.host_pinned_bytes - exact)
        step["batch (pinned)"] = _batch_bytes(config, arch, shape, pinned=True)
    else:
        step.update({k: v for k, v in transformers.items() if k in trained})
        if prediction is not None:   # the trace's weights are the transformer counted above
            step["adapters, gradients, optimizer state"] = state
            step["activations and transients"] = prediction.parts.get("activations", 0) + \
                prediction.parts.get("transient", 0)
        step["batch"] = _batch_bytes(config, arch, shape, pinned=False)
    phases["training step"] = step

    if config.sampling.samples_file:
        preview = {k: v for k, v in step.items() if "activations" not in k and "batch" not in k}
        if arch.variant.takes_driving_video:   # Animate-2 encodes its prompts its own way: read again per round
            preview["text encoder (read again for the prompts)"] = parts["text encoder"]
        else:   # the prompts' embeddings were kept when it was released (released_parts.prompts_ready)
            preview["kept prompt embeddings"] = _kept_prompt_bytes(config)
        if not cuda and prediction is not None:
            # its forward passes on the host: no more than the training step's (which keeps them for a backward)
            preview["preview forward pass"] = step.get("activations and transients", 0)
        phases["preview"] = preview
    # a backup and the final save free activation offload's buffers first (release_host_buffers; the next step
    # makes them again)
    resting = {k: v for k, v in step.items()
               if "activations" not in k and "batch" not in k and not k.startswith("offloaded block inputs")}
    # a backup copies the trainable weights and optimizer state to the host (on a CPU device they are there)
    phases["backup"] = {**resting, "backup copy of trainable + optimizer state": state if cuda else 0}
    trainable_bytes = (prediction.trainable_parameters if prediction is not None else 0) * \
        _dtype_bytes(config.output.dtype)
    final = {**resting, "trained weights in the output dtype": trainable_bytes}
    if config.training_method.value == "FINE_TUNE" and config.output.format.value == "DIFFUSERS":
        final["text encoder (read again for the folder)"] = parts["text encoder"]
    phases["final save"] = final
    from modules.planner.mapped_parts import mapped_parts
    from_files = mapped_parts(config.model)
    fine_tune = config.training_method.value == "FINE_TUNE"
    mapped = {phase: {name for name in held if _still_mapped(name, phase, from_files, cuda, fine_tune)}
              for phase, held in phases.items()}
    return HostPlan(phases, cuda, notes, mapped)


def _still_mapped(name: str, phase: str, from_files: frozenset[str], cuda: bool, fine_tune: bool) -> bool:
    """Whether part `name` in `phase` is still its file's mapping: read in the file's own dtype (`from_files`) and
    not copied since. On CUDA every part goes to the device for its work and its host copy after is new (the
    encoders moved back after their caching pass; a part read again is mapped again); on a CPU a full fine-tune's
    optimizer writes the trained weights (private pages written become anonymous)."""
    part = name.split(" (")[0]
    if part not in from_files:
        return False
    if "read again" in name:
        return True
    if cuda:
        moved_in = {"text encoder": "caching: text encoding", "VAE": "caching: VAE / image encoding",
                    "image encoder": "caching: VAE / image encoding"}.get(part, "training step")
        return PHASES.index(phase) < PHASES.index(moved_in)
    return not (fine_tune and part.startswith("transformer") and "not trained" not in name
                and PHASES.index(phase) >= PHASES.index("training step"))


def _text_activation_bytes(config: TrainConfig) -> int:
    """The text encoder's largest live tensors for one 512-token prompt: its gated feed-forward's two inputs, their
    product and output (4 x tokens x d_ff) and a few residual streams (4 x tokens x d_model), in its dtype."""
    text = _part_config(config, "text_encoder", "umt5-xxl.json")
    return 512 * (4 * text["d_ff"] + 4 * text["d_model"]) * _dtype_bytes(config.model.text_encoder.weight_dtype)


def _offloaded_inputs(config: TrainConfig, arch) -> int:
    """How many block inputs activation offload holds at the end of the forward pass: one per checkpointed block
    (every swapped block is checkpointed)."""
    if not config.performance.activation_offload:
        return 0
    layers = arch.transformer["num_layers"]
    checkpointed = set(range(layers - min(config.performance.block_swap, layers), layers))
    if config.gradient_checkpointing:
        checkpointed |= set(range(0, layers, max(1, config.performance.checkpoint_every)))
    return len(checkpointed)


def _trained_experts(config: TrainConfig, arch) -> set[str]:
    if not arch.variant.has_two_experts:
        return {"transformer"}
    return {"high": {"transformer"}, "low": {"transformer_2"},
            "both": {"transformer", "transformer_2"}}[config.expert]


def _batch_bytes(config: TrainConfig, arch, shape, pinned: bool) -> int:
    """One batch of cached latents and prompt embeddings (and its page-locked copy on CUDA)."""
    z, frames, height, width = arch.latent_shape(shape.frames, shape.height, shape.width)
    latents = shape.batch_size * z * frames * height * width * 4
    text = shape.batch_size * 512 * arch.text_dim * 2
    if not pinned:
        return latents + text
    return latents + text + pinned_bytes(latents) + pinned_bytes(text)

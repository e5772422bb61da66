"""The official sampling settings of a released Wan variant (flow shift, steps, guidance per expert, the A14B
boundary), for a base read from an official release or ComfyUI files: such a base has no scheduler config of its
own, and diffusers' hub default (flow shift 3) is not what the official code samples with. The numbers and their
sources are in resources/wan_configs/<variant>.json ("sampling"); a diffusers folder keeps its own scheduler
config and carries none of these (`WanModel.sampling_defaults` is None).

A sample's own settings win: these fill in only what the sample (its samples file, the sampling section, the
command line) leaves unset."""
from dataclasses import dataclass

# Wan 2.1 I2V's lower shift applies at 480p (generate.py: size 832*480 or 480*832); smaller previews count as 480p
AREA_480P = 832 * 480


@dataclass(frozen=True)
class SamplingDefaults:
    flow_shift: float
    steps: int
    guidance: float                          # the (high-noise) transformer's
    guidance_2: float | None = None          # A14B: the low-noise expert's (transformer_2)
    boundary_ratio: float | None = None      # A14B: where the low-noise expert takes over
    flow_shift_480p: float | None = None     # Wan 2.1 I2V: the shift at 480p and below
    source: str = ""

    @classmethod
    def from_json(cls, data: dict) -> "SamplingDefaults":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})

    def flow_shift_for(self, width: int, height: int) -> float:
        if self.flow_shift_480p is not None and width * height <= AREA_480P:
            return self.flow_shift_480p
        return self.flow_shift

    def describe(self) -> str:
        """The run plan's line."""
        shift = f"flow shift {self.flow_shift:g}"
        if self.flow_shift_480p is not None:
            shift += f" ({self.flow_shift_480p:g} at 480p and below)"
        guidance = f"guidance {self.guidance:g}" if self.guidance_2 is None else \
            f"guidance {self.guidance:g} high-noise / {self.guidance_2:g} low-noise expert"
        boundary = f", boundary {self.boundary_ratio:g}" if self.boundary_ratio is not None else ""
        return f"{shift}, {self.steps} steps, {guidance}{boundary} ({self.source})"


def sample_updates(defaults: SamplingDefaults | None, sample, width: int, height: int) -> dict:
    """The settings a SampleConfig takes from `defaults`: those it left unset (not in its model_fields_set; a flow
    shift of None). A guidance the sample set applies to both experts unless it set guidance_2 too (SampleConfig's
    meaning of None)."""
    if defaults is None:
        return {}
    explicit = sample.model_fields_set
    updates: dict = {}
    if sample.flow_shift is None:
        updates["flow_shift"] = defaults.flow_shift_for(width, height)
    if "steps" not in explicit:
        updates["steps"] = defaults.steps
    if "guidance" not in explicit:
        updates["guidance"] = defaults.guidance
        if sample.guidance_2 is None and defaults.guidance_2 is not None:
            updates["guidance_2"] = defaults.guidance_2
    return updates


DISTILLED_ANIMATE_2_PIPELINE = "WanAnimate2DistilledModularPipeline"


def folder_defaults(model_index: dict, scheduler_config: dict) -> SamplingDefaults | None:
    """A diffusers folder's defaults where its pipeline has settings of its own: the distilled Animate-2 release
    samples in 10 steps without classifier-free guidance (its denoise step's default and its guider's scale 1), at
    the folder's own flow shift. None for every other folder."""
    if model_index.get("_class_name") != DISTILLED_ANIMATE_2_PIPELINE:
        return None
    shift = scheduler_config.get("flow_shift") or scheduler_config.get("shift") or 1.0
    return SamplingDefaults(flow_shift=float(shift), steps=10, guidance=1.0,
                            source=f"{DISTILLED_ANIMATE_2_PIPELINE}'s own")

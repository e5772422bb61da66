from enum import Enum

from modules.util.enum.ModelType import ModelType


class WanVariant(str, Enum):
    """A Wan architecture, as detected from the loaded configs (never from a file name)."""

    T2V = "T2V"            # Wan 2.1 T2V 1.3B / 14B
    I2V = "I2V"            # Wan 2.1 I2V 14B 480p / 720p
    FLF2V = "FLF2V"        # Wan 2.1 FLF2V 14B
    TI2V_5B = "TI2V_5B"    # Wan 2.2 TI2V 5B: 48-channel VAE, per-token timesteps
    T2V_A14B = "T2V_A14B"  # Wan 2.2 T2V A14B: two experts
    I2V_A14B = "I2V_A14B"  # Wan 2.2 I2V A14B: two experts
    VACE = "VACE"            # Wan 2.1 VACE 1.3B / 14B: T2V blocks plus VACE blocks fed a control context
    VACE_A14B = "VACE_A14B"  # Wan 2.2 VACE-Fun A14B: two experts, each with its VACE blocks

    def __str__(self) -> str:
        return self.value

    @property
    def model_type(self) -> ModelType:
        return ModelType.WAN_2_2 if self in (WanVariant.TI2V_5B, WanVariant.T2V_A14B, WanVariant.I2V_A14B,
                                             WanVariant.VACE_A14B) else ModelType.WAN_2_1

    @property
    def has_image_encoder(self) -> bool:
        return self in (WanVariant.I2V, WanVariant.FLF2V)

    @property
    def has_two_experts(self) -> bool:
        return self in (WanVariant.T2V_A14B, WanVariant.I2V_A14B, WanVariant.VACE_A14B)

    @property
    def takes_image_condition(self) -> bool:
        """True when the transformer input is cat(noisy latents, mask, condition latents)."""
        return self in (WanVariant.I2V, WanVariant.FLF2V, WanVariant.I2V_A14B)

    @property
    def native_fps(self) -> int:
        return 24 if self is WanVariant.TI2V_5B else 16

    @property
    def spatial_unit(self) -> int:
        """Side lengths must be multiples of this: VAE spatial stride x transformer patch size."""
        return 32 if self is WanVariant.TI2V_5B else 16

    # --- control models (DESIGN.md section 11): what conditions the variant takes -------------------------------

    @property
    def is_vace(self) -> bool:
        """A `WanVACETransformer3DModel`: control video, mask and reference images through its VACE blocks."""
        return self in (WanVariant.VACE, WanVariant.VACE_A14B)

    @property
    def takes_control_video(self) -> bool:
        return self.is_vace

    @property
    def takes_control_mask(self) -> bool:
        return self.is_vace

    @property
    def takes_reference_images(self) -> bool:
        return self.is_vace

    @property
    def prepends_references(self) -> bool:
        """Reference images are extra latent frames before the video (cut from the prediction before the loss)."""
        return self.is_vace

    @property
    def transformer_class_name(self) -> str:
        return "WanVACETransformer3DModel" if self.is_vace else "WanTransformer3DModel"


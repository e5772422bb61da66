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
    # VideoX-Fun's Wan-Fun models (aigc-apps/VideoX-Fun): condition latents joined to the input channels
    FUN_CONTROL = "FUN_CONTROL"            # Wan2.1-Fun Control 1.3B / 14B: noise 16 + control 16 + start image 16
    FUN_CONTROL_A14B = "FUN_CONTROL_A14B"  # Wan2.2-Fun Control A14B: noise 16 + control 16 + mask 4 + masked video 16
    FUN_INP = "FUN_INP"                    # Wan2.1-Fun InP 1.3B: noise 16 + mask 4 + masked video 16 (the I2V layout)
    ANIMATE_14B = "ANIMATE_14B"      # Wan 2.2 Animate 14B: pose latents, face video, reference image, CLIP
    ANIMATE_2_14B = "ANIMATE_2_14B"  # Wan 2.2 Animate-2 14B (and its distilled release): in-context reference

    def __str__(self) -> str:
        return self.value

    @property
    def model_type(self) -> ModelType:
        return ModelType.WAN_2_2 if self in (WanVariant.TI2V_5B, WanVariant.T2V_A14B, WanVariant.I2V_A14B,
                                             WanVariant.VACE_A14B, WanVariant.FUN_CONTROL_A14B) or self.is_animate else ModelType.WAN_2_1

    @property
    def has_image_encoder(self) -> bool:
        # the Wan2.1-Fun models are VideoX-Fun's model_type "i2v": CLIP image tokens (zeros without an image)
        return self in (WanVariant.I2V, WanVariant.FLF2V, WanVariant.FUN_CONTROL, WanVariant.FUN_INP) \
            or self.is_animate

    @property
    def has_two_experts(self) -> bool:
        return self in (WanVariant.T2V_A14B, WanVariant.I2V_A14B, WanVariant.VACE_A14B, WanVariant.FUN_CONTROL_A14B)

    @property
    def takes_image_condition(self) -> bool:
        """True when the transformer input is cat(noisy latents, mask, condition latents)."""
        return self in (WanVariant.I2V, WanVariant.FLF2V, WanVariant.I2V_A14B, WanVariant.FUN_INP)

    @property
    def native_fps(self) -> int:
        # Animate: sample_fps 30 of the official wan/configs/wan_animate_14B.py; Animate-2: diffusers' default 24
        return {WanVariant.TI2V_5B: 24, WanVariant.ANIMATE_14B: 30, WanVariant.ANIMATE_2_14B: 24}.get(self, 16)

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
    def is_fun_control(self) -> bool:
        """A Wan-Fun Control model: the control video's latents (and a start image or inpaint latents) joined to the
        noise in the input channels (modules/model/fun_condition.py)."""
        return self in (WanVariant.FUN_CONTROL, WanVariant.FUN_CONTROL_A14B)

    @property
    def fun_condition_channels(self) -> int:
        """Input channels after the 16 noise channels: control 16 + start image 16 (Wan 2.1), control 16 + mask 4 +
        masked video 16 (Wan 2.2); 0 for other variants."""
        return {WanVariant.FUN_CONTROL: 32, WanVariant.FUN_CONTROL_A14B: 36}.get(self, 0)

    @property
    def takes_control_video(self) -> bool:
        return self.is_vace or self.is_fun_control

    @property
    def takes_control_mask(self) -> bool:
        """A mask video beside the control (white = generate): VACE's, and Wan2.2-Fun Control A14B's inpaint mask."""
        return self.is_vace or self is WanVariant.FUN_CONTROL_A14B

    @property
    def takes_reference_images(self) -> bool:
        return self.is_vace

    # --- character models (DESIGN.md section 11): what conditions the variant takes ------------------------------

    @property
    def is_animate(self) -> bool:
        """Wan2.2-Animate or Animate-2: a character (reference image) driven by a video."""
        return self in (WanVariant.ANIMATE_14B, WanVariant.ANIMATE_2_14B)

    @property
    def takes_pose_video(self) -> bool:
        """Pose latents added to the patch embedding (`pose_patch_embedding`)."""
        return self is WanVariant.ANIMATE_14B

    @property
    def takes_face_video(self) -> bool:
        """Face crops through the motion and face encoders into the face adapter blocks (every 5th block)."""
        return self is WanVariant.ANIMATE_14B

    @property
    def takes_driving_video(self) -> bool:
        """Animate-2: the driving video itself, attended in context through the reference KV cache."""
        return self is WanVariant.ANIMATE_2_14B

    @property
    def takes_reference_image(self) -> bool:
        """A reference character image, as a latent frame and as CLIP image tokens."""
        return self.is_animate

    @property
    def takes_replacement(self) -> bool:
        """Replace mode: a background video and a character mask condition the generated frames."""
        return self is WanVariant.ANIMATE_14B

    @property
    def prepends_references(self) -> bool:
        """Reference images are extra latent frames before the video (cut from the prediction before the loss):
        VACE's references, Animate's reference character."""
        return self.is_vace or self is WanVariant.ANIMATE_14B

    @property
    def frozen_transformer_parts(self) -> tuple[str, ...]:
        """Transformer modules a fine-tune leaves frozen unless fine_tune.layer_filter names them: Animate's motion
        and face encoders (pretrained feature extractors, not what a character fine-tune should move)."""
        return ("motion_encoder.", "face_encoder.") if self is WanVariant.ANIMATE_14B else ()

    @property
    def transformer_class_name(self) -> str:
        return {WanVariant.VACE: "WanVACETransformer3DModel", WanVariant.VACE_A14B: "WanVACETransformer3DModel",
                WanVariant.ANIMATE_14B: "WanAnimateTransformer3DModel",
                WanVariant.ANIMATE_2_14B: "WanAnimate2Transformer3DModel"}.get(self, "WanTransformer3DModel")

    # --- words and files for people (the GUI's model and control tabs, the docs) -----------------------------------

    @property
    def display_name(self) -> str:
        return {WanVariant.T2V: "Wan 2.1 T2V", WanVariant.I2V: "Wan 2.1 I2V", WanVariant.FLF2V: "Wan 2.1 FLF2V",
                WanVariant.TI2V_5B: "Wan 2.2 TI2V-5B", WanVariant.T2V_A14B: "Wan 2.2 T2V-A14B",
                WanVariant.I2V_A14B: "Wan 2.2 I2V-A14B", WanVariant.VACE: "Wan 2.1 VACE",
                WanVariant.VACE_A14B: "Wan 2.2 VACE-Fun A14B", WanVariant.FUN_CONTROL: "Wan 2.1 Fun Control",
                WanVariant.FUN_CONTROL_A14B: "Wan 2.2 Fun Control A14B", WanVariant.FUN_INP: "Wan 2.1 Fun InP",
                WanVariant.ANIMATE_14B: "Wan 2.2 Animate 14B", WanVariant.ANIMATE_2_14B: "Wan 2.2 Animate-2 14B"}[self]

    @property
    def animate_modes(self) -> tuple[str, ...]:
        """The `animate.mode` values the variant trains: replace only where it takes a background and a mask."""
        if not self.is_animate:
            return ()
        return ("animate", "replace") if self.takes_replacement else ("animate",)

    @property
    def clip_companions(self) -> tuple[str, ...]:
        """What training reads beside each clip, by role, from the capabilities above (the data loader's finders
        give each role its file: modules/dataLoader/vace_scan.py, mask_scan.py, animate_scan.py). A Wan-Fun
        model's start image is the clip's own first frame and its mask video is for samples only: its clips carry
        the control alone. "background" and "mask" of a character model are needed in replace mode only."""
        roles = ["control"] if self.takes_control_video else []
        if self.is_vace:
            roles += ["mask", "references"] if self.takes_reference_images else ["mask"]
        roles += [role for role, takes in (("pose", self.takes_pose_video), ("face", self.takes_face_video),
                                           ("driving", self.takes_driving_video),
                                           ("reference", self.takes_reference_image)) if takes]
        return tuple(roles + (["background", "mask"] if self.takes_replacement else []))

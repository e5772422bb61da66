"""Simple controls computed from a clip's own frames (`data.control.derive`), with OpenCV. Pose and depth come from
the user's annotators (docs/vace.md); these two follow the official VACE annotators' output form: `canny` as
ali-vilab/VACE's CannyAnnotator (cv2.Canny with thresholds 100 / 200 on the grey image, white edges on black),
`gray` as its GrayAnnotator (the luminance, repeated to three channels)."""
import cv2
import numpy as np

DERIVED_CONTROLS = ("canny", "gray")
CANNY_THRESHOLDS = (100, 200)


def derive_control(frames: np.ndarray, kind: str) -> np.ndarray:
    """uint8 (F, H, W, 3) RGB frames -> the derived control, uint8 (F, H, W, 3)."""
    if kind not in DERIVED_CONTROLS:
        raise ValueError(f"derive {kind!r}: one of {', '.join(DERIVED_CONTROLS)}")
    grey = [cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2GRAY) for frame in frames]
    if kind == "canny":
        grey = [cv2.Canny(frame, *CANNY_THRESHOLDS) for frame in grey]
    return np.repeat(np.stack(grey)[..., None], 3, axis=-1)

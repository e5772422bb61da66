"""Simple controls computed from a clip's own frames (`data.control.derive`), with OpenCV, as the official VACE
annotators compute them (ali-vilab/VACE `vace/annotators/`), so that a model sees the controls it was trained with.
Pose and depth come from the user's annotators (docs/vace.md).

- `canny`: cv2.Canny with thresholds 100 / 200 on the colour frame (OpenCV takes the strongest channel's gradient),
  the defaults of VACE's CannyAnnotator (scepter's), white edges on black;
- `gray`: VACE's GrayAnnotator, `cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)` on the RGB frame as it does (so red and
  blue weights are swapped against the usual luminance), repeated to three channels.
"""
import cv2
import numpy as np

DERIVED_CONTROLS = ("canny", "gray")
CANNY_THRESHOLDS = (100, 200)


def derive_control(frames: np.ndarray, kind: str) -> np.ndarray:
    """uint8 (F, H, W, 3) RGB frames -> the derived control, uint8 (F, H, W, 3)."""
    if kind not in DERIVED_CONTROLS:
        raise ValueError(f"derive {kind!r}: one of {', '.join(DERIVED_CONTROLS)}")
    frames = [np.ascontiguousarray(frame) for frame in frames]
    if kind == "canny":
        single = [cv2.Canny(frame, *CANNY_THRESHOLDS) for frame in frames]
    else:
        single = [cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY) for frame in frames]
    return np.repeat(np.stack(single)[..., None], 3, axis=-1)

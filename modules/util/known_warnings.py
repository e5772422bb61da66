"""Warnings of the libraries that say nothing a user of this trainer can act on, hidden at the entry points
(scripts/_bootstrap.py). Each is matched by its logger and text, so every other warning still shows.

- transformers: "`CLIPImageProcessor` requires torchvision (not installed); falling back to ..." - the project never
  installs torchvision on purpose (DESIGN.md section 3) and the PIL processor is the one it wants.
- torch: "Mismatch dtype between input and weight ... Cannot dispatch to fused implementation" from rms_norm, when
  bf16 activations meet the float32 norm weights that diffusers keeps in float32 on purpose; the unfused path gives
  the same result.
- PIL: DecompressionBombWarning ("Image size (N pixels) exceeds limit ...") names no file; video_io.read_image logs
  its own warning naming the image instead.
- bitsandbytes: "Failed to load CPU gemm_4bit_forward from kernels-community" - an optional CPU kernel of 4-bit
  layers, which this project does not use on the CPU.
"""
import logging
import warnings

# logger name (the module that logs it) -> a piece of the message
_LOGGED = {
    "transformers.utils.import_utils": "requires torchvision (not installed)",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def hide_known_warnings() -> None:
    warnings.filterwarnings("ignore", message=r"Mismatch dtype between input and weight", category=UserWarning)
    from PIL import Image
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    for name, text in _LOGGED.items():
        logger = logging.getLogger(name)  # the same object the library gets later with getLogger(__name__)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(text))

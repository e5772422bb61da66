"""The result's file name as the user meant it: a LoRA, embedding or single-file model named without an extension
(`output.destination=out/my_lora`) is written as `out/my_lora.safetensors`, and the run says so."""
import logging
from pathlib import Path

from modules.util.config.TrainConfig import TrainConfig

log = logging.getLogger(__name__)


def add_missing_extension(config: TrainConfig) -> str | None:
    """Adds `.safetensors` to a file destination that has no extension; returns the note it logged (None when the
    destination is a folder format, an existing folder or already has an extension)."""
    destination = Path(config.output.destination)
    if config.output.format.value == "DIFFUSERS" or destination.suffix or destination.is_dir() \
            or not destination.name:
        return None
    named = destination.with_name(destination.name + ".safetensors")
    config.output.destination = str(named)
    note = (f"note: output.destination {str(destination)!r} has no extension; the {config.output.format.value} "
            f"file is written as {str(named)!r}")
    log.warning(note)
    return note

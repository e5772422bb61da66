"""The previews' prompts around caching: judged before caching, their embeddings kept when the text encoder goes.

A preview file that cannot run on the model is a config error found before caching, not at the first preview hours
in. After caching a training run releases the text encoder; the previews' prompt embeddings are taken first, so that
previews never load it again (Animate-2 previews read a driving video's own text: they keep nothing here).
"""
from __future__ import annotations

import logging
from functools import partial

from modules.util.config.config_io import ConfigError

log = logging.getLogger(__name__)


def check_samples(trainer) -> None:
    """Every preview of `trainer.config.sampling.samples_file` must be able to run on `trainer.model`."""
    samples_file = trainer.config.sampling.samples_file
    if not samples_file:
        return
    from modules.modelSampler.TrainingSampler import TrainingSampler
    from modules.modelSampler.WanModelSampler import SampleError
    from modules.util.sample_definitions import SampleDefinitionError
    try:
        for note in TrainingSampler(trainer).validate():
            log.warning("%s", note)
    except (SampleError, SampleDefinitionError) as error:
        raise ConfigError([f"sampling.samples_file {samples_file!r}: {error}"]) from None


def release_text_encoder(trainer) -> None:
    """Keeps the previews' prompt embeddings, then releases the text encoder (a diffusers save loads it again)."""
    from modules.model.released_parts import release_text_encoder as release
    from modules.modelLoader.wan.WanBaseModelLoader import load_text_encoder_only
    if trainer.config.sampling.samples_file and not trainer.model.variant.takes_driving_video:
        from modules.modelSampler.TrainingSampler import TrainingSampler
        TrainingSampler(trainer).remember_prompts()   # the file was read and judged by check_samples
    release(trainer.model, partial(load_text_encoder_only, trainer.config.model))

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig

# Fixed evaluation sigmas per validation pass: each one is a forward pass over every validation item.
MAX_VALIDATION_TIMESTEPS = 100


class ValidationConfig(BaseConfig):
    """The validation loss (docs/validation.md): the model's loss on held-out items (concepts marked `validation`,
    or `data.validation_split`), at fixed sigmas and fixed noise, so two evaluations differ only by the weights.
    It runs only when there are validation items."""

    every_n_steps: int = Field(0, ge=0, le=10 ** 12, description="evaluate after every N optimizer steps; 0: only "
                               "before training and at the end")
    before_training: bool = Field(True, description="evaluate once before the first step (the base model's value)")
    timesteps: int = Field(5, ge=1, le=MAX_VALIDATION_TIMESTEPS, description="fixed sigmas per evaluation, spread "
                           "over the run's timestep distribution (and the trained expert's sigma range)")
    batch_size: int = Field(0, ge=0, le=4096, description="validation items per forward pass; 0: the training "
                            "batch_size")
    keep_best: bool = Field(False, description="keep the backup with the lowest validation loss in "
                            "<workspace>/backup/best, apart from the rolling backups")

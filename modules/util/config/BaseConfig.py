from pydantic import BaseModel, ConfigDict


class BaseConfig(BaseModel):
    """Every config section: unknown keys are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

from pydantic import BaseModel, ConfigDict


class BaseConfig(BaseModel):
    """Every config section: unknown keys are errors (a typo must not be silently ignored); NaN and infinities are
    refused in every float field (a learning rate of Infinity trains into NaN; a ratio of NaN crashes the buckets)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)

class PipelineError(ValueError):
    """A pipeline that is wired wrongly (a missing or duplicate producer, an undeclared or unknown item name, an
    index out of range, a module that does not return what it declared). Raised at build time where possible."""

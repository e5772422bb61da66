"""Loaders, savers, setups, samplers and data loaders register themselves for a (ModelType, TrainingMethod) key,
so adding a model touches its own files plus one ModelType entry instead of switch statements."""
from collections.abc import Callable
from typing import TypeVar

from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod

T = TypeVar("T")

_registry: dict[tuple[str, ModelType, TrainingMethod], type] = {}


def register(role: str, model_types: list[ModelType], methods: list[TrainingMethod]) -> Callable[[type[T]], type[T]]:
    def decorate(cls: type[T]) -> type[T]:
        for model_type in model_types:
            for method in methods:
                key = (role, model_type, method)
                if key in _registry and _registry[key] is not cls:
                    raise RuntimeError(f"{role} for {model_type}/{method} registered twice: "
                                       f"{_registry[key].__name__} and {cls.__name__}")
                _registry[key] = cls
        return cls
    return decorate


def lookup(role: str, model_type: ModelType, method: TrainingMethod) -> type:
    try:
        return _registry[(role, model_type, method)]
    except KeyError:
        known = sorted(f"{m}/{t}" for r, m, t in _registry if r == role)
        raise KeyError(f"no {role} is registered for {model_type}/{method}; registered: {known}") from None

from enum import Enum


class TrainingMethod(str, Enum):
    FINE_TUNE = "FINE_TUNE"
    LORA = "LORA"
    EMBEDDING = "EMBEDDING"

    def __str__(self) -> str:
        return self.value

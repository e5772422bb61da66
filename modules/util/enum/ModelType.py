from enum import Enum


class ModelType(str, Enum):
    WAN_2_1 = "WAN_2_1"
    WAN_2_2 = "WAN_2_2"

    def __str__(self) -> str:
        return self.value

"""Lightning's enums of string choices; each member compares equal to its string."""

from __future__ import annotations

from enum import Enum


class LightningEnum(str, Enum):
    """A str enum that compares equal to its value ignoring case: `GradClipAlgorithmType.NORM ==
    "norm"`."""

    @classmethod
    def from_str(cls, value: str) -> LightningEnum | None:
        return next((m for m in cls if m.value.lower() == value.lower()), None)

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, Enum) else other
        return isinstance(other, str) and self.value.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.value.lower())


class GradClipAlgorithmType(LightningEnum):
    """`Trainer(gradient_clip_algorithm=...)`: clip by "value" or by global "norm"."""

    VALUE = "value"
    NORM = "norm"

    @staticmethod
    def supported_type(val: str) -> bool:
        return any(x.value == val for x in GradClipAlgorithmType)

    @staticmethod
    def supported_types() -> list[str]:
        return [x.value for x in GradClipAlgorithmType]

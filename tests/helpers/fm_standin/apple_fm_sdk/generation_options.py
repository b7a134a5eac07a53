"""``GenerationOptions``, ``SamplingMode`` and ``SamplingModeType`` as apple-fm-sdk 0.2.1
has them, ``to_dict`` included (it writes ``top_k``, ``top_p`` and ``seed`` as strings), and
:func:`native_options`: how the framework's Swift side (``parseGenerationOptions``) reads
that JSON, numbers only."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class SamplingModeType(str, Enum):  # noqa: UP042 (as the SDK declares it)
    GREEDY = "greedy"
    RANDOM = "random"


@dataclass
class SamplingMode:
    mode_type: SamplingModeType
    top: int | None = None
    probability_threshold: float | None = None
    seed: int | None = None

    @classmethod
    def greedy(cls) -> SamplingMode:
        return cls(mode_type=SamplingModeType.GREEDY)

    @classmethod
    def random(cls, top: int | None = None, probability_threshold: float | None = None,
               seed: int | None = None) -> SamplingMode:
        if top is not None and probability_threshold is not None:
            raise ValueError("Cannot specify both 'top' and 'probability_threshold'. "
                             "Choose one sampling constraint.")
        if top is not None and (not isinstance(top, int) or top <= 0):
            raise ValueError("'top' must be a positive integer")
        if probability_threshold is not None and (
                not isinstance(probability_threshold, int | float)
                or not 0.0 <= probability_threshold <= 1.0):
            raise ValueError("'probability_threshold' must be between 0.0 and 1.0")
        if seed is not None and not isinstance(seed, int):
            raise ValueError("'seed' must be an integer")
        return cls(mode_type=SamplingModeType.RANDOM, top=top,
                   probability_threshold=probability_threshold, seed=seed)


@dataclass
class GenerationOptions:
    sampling: SamplingMode | None = None
    temperature: float | None = None
    maximum_response_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None:
            if not isinstance(self.temperature, int | float):
                raise ValueError("'temperature' must be a number")
            if self.temperature < 0.0:
                raise ValueError("'temperature' must be non-negative")
        if self.maximum_response_tokens is not None:
            if not isinstance(self.maximum_response_tokens, int):
                raise ValueError("'maximum_response_tokens' must be an integer")
            if self.maximum_response_tokens <= 0:
                raise ValueError("'maximum_response_tokens' must be positive")
        if self.sampling is not None and not isinstance(self.sampling, SamplingMode):
            raise ValueError("'sampling' must be a SamplingMode instance")

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.sampling is not None:
            sampling: dict[str, Any] = {"mode": self.sampling.mode_type.value}
            if self.sampling.mode_type == SamplingModeType.RANDOM:
                if self.sampling.top is not None:
                    sampling["top_k"] = str(self.sampling.top)
                if self.sampling.probability_threshold is not None:
                    sampling["top_p"] = str(self.sampling.probability_threshold)
                if self.sampling.seed is not None:
                    sampling["seed"] = str(self.sampling.seed)
            result["sampling"] = sampling
        if self.temperature is not None:
            result["temperature"] = self.temperature
        if self.maximum_response_tokens is not None:
            result["maximum_response_tokens"] = self.maximum_response_tokens
        return result


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def native_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """What the Swift side makes of the options JSON: ``sampling`` is ``greedy``, or
    ``random`` with ``top_k`` or ``top_p`` (numbers only, as ``as? Int`` / ``as? Double``
    read JSON) and the ``seed`` beside them (``as? UInt64``); neither: no sampling set."""
    out: dict[str, Any] = {"sampling": None, "temperature": None,
                           "maximum_response_tokens": None}
    if not options:
        return out
    sampling = options.get("sampling")
    if isinstance(sampling, dict) and isinstance(sampling.get("mode"), str):
        if sampling["mode"] == "greedy":
            out["sampling"] = {"mode": "greedy"}
        elif sampling["mode"] == "random":
            seed = sampling.get("seed")
            seed = seed if isinstance(seed, int) and not isinstance(seed, bool) \
                and 0 <= seed < 2**64 else None
            top_k = sampling.get("top_k")
            top_p = sampling.get("top_p")
            if isinstance(top_k, int) and not isinstance(top_k, bool):
                out["sampling"] = {"mode": "random", "top_k": top_k, "seed": seed}
            elif _number(top_p):
                out["sampling"] = {"mode": "random", "top_p": float(top_p), "seed": seed}
    if _number(options.get("temperature")):
        out["temperature"] = float(options["temperature"])
    if isinstance(options.get("maximum_response_tokens"), int):
        out["maximum_response_tokens"] = options["maximum_response_tokens"]
    return out

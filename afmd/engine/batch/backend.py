"""Which of the engine's two code paths runs: the CPU layout or the GPU one.

afmd was first tuned on MLX's CPU backend, where some work is faster on the host than in
MLX: the output projection is stored transposed (:mod:`afmd.engine.batch.cpu_layout`), a
verification pass projects its hidden states with numpy (:mod:`afmd.engine.speculative.verify_head`)
and log-probabilities are normalised by numpy (:mod:`afmd.engine.batch.logprobs`). On a GPU
(Metal, or MLX's CUDA backend) each of those would move data off the device for nothing:
there the whole step stays in MLX, and kernels are compiled the first time a shape is
seen, so a loaded model is run once before it serves (:mod:`afmd.engine.batch.warmup`).

Every such choice asks :func:`current` here, so the two paths are named in one place and
``AFMD_BACKEND_LAYOUT=gpu`` forces the GPU path on a CPU (how the tests and CI keep it
honest without a GPU: its numbers are MLX's own in either case), and ``cpu`` the CPU path
on a GPU, for comparison. ``auto`` (or unset) follows the device MLX computes on.

What depends on the device itself rather than on the path is here too:
:func:`verify_builds_plans` (MLX's CUDA backend builds a cuDNN attention plan for every
new key length a multi-token pass has) and :func:`prepare_mlx` (MLX's CUDA caches, which
raise an error once they have missed twice their size over a process's life).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

#: The switch: ``auto`` (the default), ``cpu`` or ``gpu``.
ENV = "AFMD_BACKEND_LAYOUT"
CHOICES = ("auto", "cpu", "gpu")

Layout = Literal["cpu", "gpu"]
DeviceKind = Literal["cpu", "metal", "cuda", "gpu"]

#: MLX's CUDA caches that count misses over the process's life and raise
#: "Cache thrashing is happening" past twice their capacity: a server sees a new captured
#: graph for each new mix of rows and a new attention plan for each new prompt shape, so at
#: MLX's defaults (400 and 256) a long-running server would start failing steps. Larger
#: sizes push that far out (each entry is a small host-side object); an operator's own
#: value is kept.
CUDA_CACHE_SIZES = {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_CUDA_SDPA_CACHE_SIZE": "2048"}


@dataclass(frozen=True, slots=True)
class Backend:
    """The engine's path (``layout``) and the device MLX computes on (``device``)."""

    layout: Layout
    device: DeviceKind
    #: Set by :data:`ENV` rather than followed from the device.
    forced: bool = False

    @property
    def host_layout(self) -> bool:
        """The CPU path: the transposed output projection, numpy's verification
        projection and log-softmax."""
        return self.layout == "cpu"

    @property
    def warms_up(self) -> bool:
        """Run a loaded model once before it serves (kernels compiled at load, not on the
        first request)."""
        return self.layout == "gpu"

    def describe(self) -> str:
        how = f"forced by {ENV}" if self.forced else "auto"
        return f"{self.layout} path on MLX's {self.device} device ({how})"


def current() -> Backend:
    """The backend of this process now (the environment read on each call: cheap, and a
    test may change it)."""
    return _resolve(os.environ.get(ENV, "auto").strip().lower() or "auto", device_kind())


def _resolve(choice: str, device: DeviceKind) -> Backend:
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "auto":
        return Backend("cpu" if device == "cpu" else "gpu", device)
    return Backend("cpu" if choice == "cpu" else "gpu", device, forced=True)


def device_kind() -> DeviceKind:
    """What MLX computes on by default: "cpu", "metal", "cuda" (or "gpu")."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "gpu"


def prepare_mlx() -> None:
    """Settings MLX reads when it first computes on a device, set before a model loads:
    MLX's CUDA caches (:data:`CUDA_CACHE_SIZES`), on its CUDA backend only."""
    if device_kind() != "cuda":
        return
    for name, value in CUDA_CACHE_SIZES.items():
        os.environ.setdefault(name, value)


def verify_builds_plans(model: Any, backend: Backend | None = None) -> bool:
    """Whether a forward pass over several new tokens (a speculative verification)
    builds an attention plan each time: MLX's CUDA backend runs half-precision attention
    over more than one query through cuDNN, whose plan is keyed by the key length, which
    every verification pass has anew (building one costs more than the steps a typical
    proposal saves, and each counts toward the miss limit of :data:`CUDA_CACHE_SIZES`).
    Unless ``MLX_CUDA_USE_CUDNN_SDPA=0`` turns that off."""
    backend = backend or current()
    if backend.device != "cuda" or os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") == "0":
        return False
    return compute_dtype(model) in ("float16", "bfloat16")


def compute_dtype(model: Any) -> str | None:
    """The floating type of a model's first floating parameters (a quantized model's
    scales), the type its attention runs in."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):  # type: ignore[str-unpack]  # mlx types tree_flatten list-or-dict alike
        if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return None

"""A model's identity for the block cache: its weights and its tokenizer.

Two models must never share blocks (their KV state differs for the same tokens), and a
model replaced in place (a new revision downloaded into the same folder, a re-quantized
copy) must not find the old one's blocks on disk. Hashing every weight byte at each load
would cost seconds for a large model, so the weights are fingerprinted by each file's
name, size, modification time and sampled contents (its head, which holds the safetensors
header, its tail, and evenly spaced chunks between). The samples alone missed a checkpoint
that differs from another only between them (a fine-tune that changed a few tensors, such
as a fused LoRA adapter, has its base's names, sizes and most of its bytes), and its blocks
were the other's; a file written again has another modification time, so a changed
checkpoint is another model whatever it changed (a copy that keeps the times, ``cp -p`` or
``rsync -a``, keeps the identity; one that does not only recomputes). Tokenizer and
configuration files are small and hashed whole.

The same files are another model under another runtime: a block is the output of the
model's code (mlx-lm's or mlx-vlm's implementation of its architecture) run by MLX on one
device, and an upgrade that fixes that code (a rotary embedding, a norm), or a move to
another device, changes what the same prompt's KV state is. Blocks written before an
upgrade were reused after it, giving answers from the old code's state; the versions and
the device join the identity, so an upgrade starts the disk tier afresh.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

_WHOLE = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_WEIGHTS = ("*.safetensors", "*.npz", "*.gguf")
_SAMPLE = 1 << 16
_SAMPLES = 16


def _sampled(path: Path, digest: hashlib._Hash) -> None:
    st = path.stat()
    size = st.st_size
    digest.update(f"{path.name}:{size}:{st.st_mtime_ns}\n".encode())
    with path.open("rb") as f:
        if size <= _SAMPLE * (_SAMPLES + 2):
            digest.update(f.read())
            return
        offsets = [0, *((size - _SAMPLE) * i // (_SAMPLES + 1) for i in range(1, _SAMPLES + 1)),
                   size - _SAMPLE]
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(_SAMPLE))


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def runtime() -> str:
    """What computes a model's KV state besides its files: MLX, the model code and the
    device."""
    import mlx.core as mx
    import mlx_lm

    return (f"mlx {mx.__version__}; mlx-lm {mlx_lm.__version__}; "  # type: ignore[attr-defined]  # not in mlx.core's stub
            f"mlx-vlm {_version('mlx-vlm')}; {mx.default_device().type.name}")


def model_identity(folder: Path | None, name: str) -> bytes:
    """The identity of the model in ``folder`` (a model with no folder, such as a stand-in
    built in memory, is known by its ``name`` only and gets no disk tier)."""
    digest = hashlib.sha256(b"afmd-model-identity-1\n")
    digest.update(f"runtime:{runtime()}\n".encode())
    if folder is None:
        digest.update(b"name:" + name.encode())
        return digest.digest()
    for file in _WHOLE:
        path = folder / file
        if path.is_file():
            digest.update(f"{file}\n".encode())
            digest.update(path.read_bytes())
    for pattern in _WEIGHTS:
        for path in sorted(folder.glob(pattern)):
            _sampled(path, digest)
    return digest.digest()

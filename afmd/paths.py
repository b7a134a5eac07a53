"""Where afmd keeps files on disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """Root for regenerable data (e.g. the materialised demo models).

    ``$AFMD_CACHE_DIR`` wins so tests and sandboxes can redirect everything; otherwise
    the platform's cache location, because the contents can be rebuilt at any time and
    must not end up in backups. A relative ``$XDG_CACHE_HOME`` is ignored, as the XDG
    spec requires.
    """
    override = os.environ.get("AFMD_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "afmd"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "afmd"
    return Path.home() / ".cache" / "afmd"


def models_cache_dir() -> Path:
    """Where materialised models live (the built-in demo models: ``<variant>-<fingerprint>``)."""
    return cache_dir() / "models"


def huggingface_hub_cache() -> Path:
    """The Hugging Face hub cache mlx-lm downloads into, resolved as huggingface_hub does:
    ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (also on
    macOS)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "huggingface" / "hub"

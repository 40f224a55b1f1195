"""The model-loading error every part raises, in a module that imports nothing heavy (no torch),
so that `specfleet up` and the GGUF file code can use it without loading a framework."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model directory is missing or unusable; the message says how to fix it."""

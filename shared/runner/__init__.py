"""Running a model over many sessions at once: the KV arena, packed steps, the forward pass."""

from shared.runner.kv import KVArena, KVError, KVShape, KVSlot
from shared.runner.runner import RUNNER_KINDS, ModelRunner
from shared.runner.step import Segment

__all__ = ["RUNNER_KINDS", "KVArena", "KVError", "KVShape", "KVSlot", "ModelRunner", "Segment"]

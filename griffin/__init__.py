"""griffin: lossless speculative decoding with GRIFFIN / EAGLE draft heads."""

from .config import DraftConfig
from .draft import DraftModel
from .generator import GenerationResult, GenerationStats, SpecGenerator
from .target import EMBEDDED_TARGET, load_target

__all__ = ["EMBEDDED_TARGET", "DraftConfig", "DraftModel", "GenerationResult", "GenerationStats", "SpecGenerator",
           "load_target"]
__version__ = "0.1.0"

"""griffin: lossless speculative decoding with GRIFFIN / EAGLE draft heads.

The classes load on first use (``from griffin import SpecGenerator``), so that importing a light part of the package
(``griffin.io``, ``griffin.constants``) does not load torch and transformers.
"""

from importlib import import_module

from .constants import EMBEDDED_TARGET

_EXPORTS = {"DraftConfig": ".config", "DraftModel": ".draft", "GenerationResult": ".generator",
            "GenerationStats": ".generator", "SpecGenerator": ".generator", "load_target": ".target"}
__all__ = ["EMBEDDED_TARGET", *_EXPORTS]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'griffin' has no attribute {name!r}")

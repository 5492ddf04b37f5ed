"""Model families: one module per family, each registered through the pluggy hooks."""

from .base import Family, UnsupportedModelError, detect_family

__all__ = ["Family", "UnsupportedModelError", "detect_family"]

"""Attention under compiled masks: the public function and the xla reference backend."""
from .api import mask_attention

__all__ = ["mask_attention"]

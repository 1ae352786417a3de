"""The MaskSpec language: symbolic expressions, metadata, regions and the dense oracle."""
from .expr import (FALSE, TRUE, Expr, Pred, h, k, kv_len, maximum, minimum, q, q_len)
from .maskspec import MaskSpec, MetadataError, Region
from .metadata import Scalar, SegmentIds, Vector

__all__ = ["Expr", "Pred", "q", "k", "h", "q_len", "kv_len", "minimum", "maximum", "TRUE",
           "FALSE", "Region", "MaskSpec", "MetadataError", "Scalar", "Vector",
           "SegmentIds"]

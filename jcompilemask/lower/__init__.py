"""Lowering: MaskSpec -> interval expressions (sympy) -> ExecutionDescriptor."""
from .compiled import CompiledMask, compile
from .descriptor import ClassDescriptor, ExecutionDescriptor, TileConfig
from .dense import from_dense
from .dense_runtime import RuntimeDense, runtime_dense
from .hints import MaskFallbackWarning

__all__ = ["CompiledMask", "compile", "ExecutionDescriptor", "ClassDescriptor", "TileConfig",
           "from_dense", "runtime_dense", "RuntimeDense", "MaskFallbackWarning"]

"""TileLang preprocess: the ExecutionDescriptor built on the GPU by kernels generated
from a CompiledMask's lowered interval expressions (see :mod:`.codegen`).

Importing needs neither a GPU nor tilelang; :func:`tilelang_preprocess` needs both (an
SM90 GPU, and the GPU extras tilelang / apache-tvm-ffi / jax-tvm-ffi).
"""
from .api import (compile_program, compiled_function, mock_preprocess, program_for,
                  tilelang_preprocess, warm_cache)
from .codegen import KernelConfig, Program, generate, unsupported_reason

__all__ = ["tilelang_preprocess", "mock_preprocess", "program_for", "compile_program",
           "compiled_function", "warm_cache",
           "generate", "KernelConfig", "Program", "unsupported_reason"]

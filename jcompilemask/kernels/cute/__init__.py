"""CuTe DSL attention kernels for SM90 (Hopper). Importing needs no GPU and no cutlass;
the kernels compile on first use (see `api.cute_forward`, `api.cute_backward`)."""

from .api import (BackwardKey, ForwardKey, compile_backward, compile_forward, cute_backward,
                  cute_forward, preferred_forward_stages, preferred_forward_tiles)


__all__ = ["BackwardKey", "ForwardKey", "compile_backward", "compile_forward", "cute_backward",
           "cute_forward", "preferred_forward_stages", "preferred_forward_tiles"]

"""CuTe DSL attention kernels for SM90 (Hopper). Importing needs no GPU and no cutlass;
the kernels compile on first use (see `api.cute_forward`)."""

from .api import (ForwardKey, compile_forward, cute_forward, preferred_forward_stages,
                  preferred_forward_tiles)


__all__ = ["ForwardKey", "compile_forward", "cute_forward", "preferred_forward_stages",
           "preferred_forward_tiles"]

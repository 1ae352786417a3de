"""CuTe DSL attention kernels for SM90 (Hopper). Importing needs no GPU and no cutlass;
the kernels compile on first use (see `api.cute_forward`)."""

from .api import ForwardKey, compile_forward, cute_forward


def preferred_forward_tiles(head_dim: int, dtype: str = "bfloat16") -> tuple[int, int]:
    """(block_q, block_kv) to build the forward descriptor at for the cute kernel."""
    del dtype
    return (128, 128) if head_dim <= 128 else (128, 80)


__all__ = ["ForwardKey", "compile_forward", "cute_forward", "preferred_forward_tiles"]

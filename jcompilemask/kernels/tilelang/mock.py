"""A CPU interpreter for the generated kernels (tests only; slow, small shapes).

The generated body text is run as one Python generator per thread; ``T.sync_threads()``
was turned into ``yield``, and the threads of a block advance in lock step from one
barrier to the next (every thread must reach the same barriers, or this raises). Values
are Python ints; buffers reject out-of-range and negative indices, so the mock also
catches indexing bugs. Atomics are plain read-modify-writes (the interpreter is serial).
"""
from __future__ import annotations

import numpy as np

__all__ = ["run_program"]

_DT = {"int32": np.int32, "uint32": np.uint32, "uint8": np.uint8}


class Buf:
    """A numpy array read as Python ints, bounds-checked on every access."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def _idx(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) != self.arr.ndim:
            raise IndexError(f"rank {len(idx)} index into a rank-{self.arr.ndim} buffer")
        for i, n in zip(idx, self.arr.shape):
            if not 0 <= int(i) < n:
                raise IndexError(f"index {idx} out of range for shape {self.arr.shape}")
        return tuple(int(i) for i in idx)

    def __getitem__(self, idx):
        return int(self.arr[self._idx(idx)])

    def __setitem__(self, idx, v):
        v = int(v)
        info = np.iinfo(self.arr.dtype)
        if not info.min <= v <= info.max:
            raise OverflowError(f"value {v} does not fit {self.arr.dtype}")
        self.arr[self._idx(idx)] = v


def _wrap32(x):
    return (int(x) + 2 ** 31) % 2 ** 32 - 2 ** 31


class ThreadT:
    """The ``T`` namespace one mock thread sees (shared buffers are per block)."""

    def __init__(self, shared: list):
        self._shared = shared
        self._n = 0

    # allocation
    def alloc_shared(self, shape, dtype):
        if self._n == len(self._shared):
            self._shared.append(Buf(np.zeros(shape, _DT[dtype]) + 12345))   # poisoned
        buf = self._shared[self._n]
        self._n += 1
        return buf

    @staticmethod
    def alloc_local(shape, dtype):
        return Buf(np.full(shape, 777, _DT[dtype]))

    @staticmethod
    def alloc_var(dtype):
        return 0

    # scalars
    @staticmethod
    def int32(v):
        return _wrap32(v)

    @staticmethod
    def uint32(v):
        return int(v) % 2 ** 32

    @staticmethod
    def bool(v):
        return bool(v)

    @staticmethod
    def Cast(dtype, v):
        v = int(v)
        return {"uint32": v % 2 ** 32, "uint8": v % 256, "int32": _wrap32(v)}[dtype]

    @staticmethod
    def min(a, b):
        return min(a, b)

    @staticmethod
    def max(a, b):
        return max(a, b)

    @staticmethod
    def floordiv(a, b):
        assert b > 0, "generated code must guard divisors"
        return a // b

    @staticmethod
    def floormod(a, b):
        assert b > 0
        return a % b

    @staticmethod
    def ceildiv(a, b):
        return -(-a // b)

    @staticmethod
    def if_then_else(c, a, b):
        return a if c else b

    @staticmethod
    def And(a, b):
        return bool(a) and bool(b)

    @staticmethod
    def Or(a, b):
        return bool(a) or bool(b)

    @staticmethod
    def Not(a):
        return not a

    @staticmethod
    def shift_left(a, s):
        return (int(a) << int(s)) % 2 ** 32

    @staticmethod
    def serial(a, b=None):
        return range(a) if b is None else range(a, b)

    unroll = serial

    @staticmethod
    def atomic_add_at(buf, idx, v):
        buf[idx] = buf[idx] + v

    @staticmethod
    def atomic_or_at(buf, idx, v):
        buf[idx] = buf[idx] | v


def run_program(program, env: dict):
    """Run every kernel of ``program`` (a :class:`~.codegen.Program`) over ``env``.

    ``env`` maps parameter and dynamic-dimension names to numpy arrays / ints; output
    arrays are written in place.
    """
    ns: dict = {}
    exec(compile(program.mock_source, "<jcompilemask-mock>", "exec"), ns)  # noqa: S102
    benv = {k: (Buf(v) if isinstance(v, np.ndarray) else v) for k, v in env.items()}
    for name, gx, gy, threads in program.kernels:
        fn = ns[f"kernel_{name}"]
        gxv = eval(gx, {"T": ThreadT([])}, benv)   # noqa: S307 - our own generated text
        gyv = eval(gy, {"T": ThreadT([])}, benv)   # noqa: S307
        for by in range(gyv):
            for bx in range(gxv):
                shared: list = []
                gens = [fn(ThreadT(shared), bx, by, tx, benv) for tx in range(threads)]
                while True:
                    done = 0
                    for g in gens:
                        try:
                            next(g)
                        except StopIteration:
                            done += 1
                    if done == len(gens):
                        break
                    if done:
                        raise RuntimeError(f"kernel {name}: threads reached different "
                                           "barriers (divergent T.sync_threads)")

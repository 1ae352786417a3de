"""The CuTe DSL ops backend of :mod:`jcompilemask.lower.residual_program`.

Every primitive is spelled as one explicit MLIR ``arith`` op on 32-bit integers or i1
(signed compares, truncating ``divsi`` / ``remsi``, ``select``), so that what the kernel
computes is exactly what :class:`~jcompilemask.lower.residual_program.NumpyOps` computes on
CI — no reliance on how the DSL's Python operators lower (a ``Uint32(x) < Uint32(y)`` on
Int32 values once lowered to a signed compare; see ``common._unsigned_lt``).
"""
from __future__ import annotations

from cutlass import Boolean, Int32
from cutlass._mlir.dialects import arith
from cutlass.cutlass_dsl import dsl_user_op


def _iv(x, loc, ip):
    return Int32(x).ir_value(loc=loc, ip=ip)


def _bv(x, loc, ip):
    return Boolean(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def _int_op(name, a, b, *, loc=None, ip=None):
    fn = getattr(arith, name)
    return Int32(fn(_iv(a, loc, ip), _iv(b, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def _cmp(pred, a, b, *, loc=None, ip=None):
    return Boolean(arith.cmpi(getattr(arith.CmpIPredicate, pred), _iv(a, loc, ip), _iv(b, loc, ip),
                              loc=loc, ip=ip))


@dsl_user_op
def _bool_op(name, a, b, *, loc=None, ip=None):
    fn = getattr(arith, name)
    return Boolean(fn(_bv(a, loc, ip), _bv(b, loc, ip), loc=loc, ip=ip))


@dsl_user_op
def _select(c, a, b, *, loc=None, ip=None):
    return Int32(arith.select(_bv(c, loc, ip), _iv(a, loc, ip), _iv(b, loc, ip), loc=loc, ip=ip))


class CuteOps:
    """Ops for one residual evaluation inside a kernel.

    Args:
      mParams: the parameter table, int32 [Bm, W] (``ResidualProgram.table``).
      batch: the mask batch index (0 when the mask broadcasts over the batch).
      seqlen_q, seqlen_k: what ``q_len`` and ``kv_len`` read as.
    """

    def __init__(self, mParams, batch, seqlen_q, seqlen_k):
        self.mParams, self.batch = mParams, batch
        self.lengths = {"q_len": seqlen_q, "kv_len": seqlen_k}

    def const(self, v):
        return Int32(v)

    def true(self):
        return Boolean(True)

    def false(self):
        return Boolean(False)

    def length(self, name):
        return Int32(self.lengths[name])

    def param(self, offset: int):
        return Int32(self.mParams[self.batch, offset])

    def param_at(self, offset):
        return Int32(self.mParams[self.batch, offset])

    def add(self, a, b):
        return _int_op("addi", a, b)

    def sub(self, a, b):
        return _int_op("subi", a, b)

    def mul(self, a, b):
        return _int_op("muli", a, b)

    def div_trunc(self, a, b):
        return _int_op("divsi", a, b)

    def rem_trunc(self, a, b):
        return _int_op("remsi", a, b)

    def min(self, a, b):
        return _int_op("minsi", a, b)

    def max(self, a, b):
        return _int_op("maxsi", a, b)

    def select(self, c, a, b):
        return _select(c, a, b)

    def lt(self, a, b):
        return _cmp("slt", a, b)

    def le(self, a, b):
        return _cmp("sle", a, b)

    def gt(self, a, b):
        return _cmp("sgt", a, b)

    def ge(self, a, b):
        return _cmp("sge", a, b)

    def eq(self, a, b):
        return _cmp("eq", a, b)

    def ne(self, a, b):
        return _cmp("ne", a, b)

    def and_(self, a, b):
        return _bool_op("andi", a, b)

    def or_(self, a, b):
        return _bool_op("ori", a, b)

    def not_(self, a):
        return _bool_op("xori", a, Boolean(True))

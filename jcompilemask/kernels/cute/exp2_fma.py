"""exp2 on the FMA pipe: the PTX of ``common.exp2_fma`` and its constants (no cutlass
import: the CPU test ``tests/test_exp2_emulation.py`` models the same arithmetic).

2^x = 2^j * 2^f, j = floor(x), f = x - j in [0, 1):

1. clamp x to [-127, 128] with ``max.NaN`` / ``min.NaN`` (NaN stays NaN);
2. t = x + 1.5 * 2^23 rounded toward -inf (``add.rm``): t = floor(x) + 1.5 * 2^23 exactly,
   floor(x) in its low mantissa bits; j = t - 1.5 * 2^23 and f = x - j, both exact;
3. p = c0 + f (c1 + f (c2 + f c3)) ~ 2^f (3 FFMA), c0 = 1 exactly, c1..c3 the cubic of
   least maximum relative error on [0, 1) (8.56e-5), rounded to float32;
4. s = 2^j from t's bits: (t << 23) + (127 << 23) = (j + 127) << 23 mod 2^32, so j = -127
   (x < -126, -inf) gives s = +0.0 and j = 128 (x >= 128, +inf) gives s = +inf;
5. 2^x = p * s (an FMUL, not an integer add on p's exponent: a NaN p stays NaN, and
   p >= 1, s >= 2^-126 or 0 leave no denormal).

Relative error <= 8.6e-5 over x in [-126, 128) (float32 arithmetic throughout); results
below 2^-126 are exactly 0, as ``ex2.approx.ftz`` flushes them. 10 instructions on the FMA
and ALU pipes (2 FMNMX, 3 FADD, 3 FFMA, LEA, FMUL) instead of one MUFU.EX2.
"""

# c0..c3 of p(f): 1, 0.69511729, 0.22764353, 0.07706803 (float32 bit patterns)
EXP2_POLY_BITS = (0x3F800000, 0x3F31F335, 0x3E691B63, 0x3D9DD5D8)
EXP2_ROUND_BITS = 0x4B400000        # 1.5 * 2^23
EXP2_CLAMP_BITS = (0xC2FE0000, 0x43000000)      # -127, 128


def emulated_column(c: int, per_8: int) -> bool:
    """Whether column `c` of a thread's S^T fragment computes P^T's exp2 here rather than on
    the MUFU (``BackwardConfig.exp2_emu`` = `per_8`): `per_8` of every 8 consecutive columns,
    evenly spaced (2: columns 3, 7, 11, 15; 4: the odd ones; 8: all)."""
    return (c + 1) * per_8 // 8 != c * per_8 // 8


def _f(bits: int) -> str:
    return f"0f{bits:08X}"


EXP2_FMA_PTX = (
    "{\n"
    ".reg .f32 xc, t, j, f, p, s;\n"
    ".reg .b32 e;\n"
    f"max.NaN.f32 xc, $1, {_f(EXP2_CLAMP_BITS[0])};\n"
    f"min.NaN.f32 xc, xc, {_f(EXP2_CLAMP_BITS[1])};\n"
    f"add.rm.f32 t, xc, {_f(EXP2_ROUND_BITS)};\n"
    f"sub.rn.f32 j, t, {_f(EXP2_ROUND_BITS)};\n"
    "sub.rn.f32 f, xc, j;\n"
    f"fma.rn.f32 p, f, {_f(EXP2_POLY_BITS[3])}, {_f(EXP2_POLY_BITS[2])};\n"
    f"fma.rn.f32 p, p, f, {_f(EXP2_POLY_BITS[1])};\n"
    f"fma.rn.f32 p, p, f, {_f(EXP2_POLY_BITS[0])};\n"
    "mov.b32 e, t;\n"
    "shl.b32 e, e, 23;\n"
    "add.s32 e, e, 0x3F800000;\n"
    "mov.b32 s, e;\n"
    "mul.rn.f32 $0, p, s;\n"
    "}"
)

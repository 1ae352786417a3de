"""scripts/host_flags.py: the CPU flags a kernel pack's host launchers need."""
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("host_flags", ROOT / "scripts" / "host_flags.py")
host_flags = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_flags)

# The packing CPU of session 34 (AMD EPYC): every optional AVX-512 extension.
EPYC = set("fma movbe popcnt avx f16c bmi1 avx2 bmi2 avx512f avx512dq adx avx512ifma avx512cd "
           "sha_ni avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes "
           "vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_vp2intersect sse4_2".split())


def test_table_cases():
    host_flags.self_test()


def test_launcher_mnemonics_need_only_the_base_flags():
    # What the packed launchers held in session 34 (objdump over 88 kernel.o files).
    used = {"mov", "movabs", "vmovups", "vpmullq", "vpternlogq", "vpermt2q", "kshiftrb", "kmovd",
            "bzhi", "bextr", "mulx", "vinserti32x4", "vpbroadcastq", "vzeroupper"}
    got = host_flags.needed(EPYC, used)
    assert got == sorted("avx avx2 avx512f avx512bw avx512cd avx512dq avx512vl bmi1 bmi2 f16c fma "
                         "movbe popcnt".split())
    assert "avx512_vp2intersect" not in got


@pytest.mark.skipif(not (shutil.which("as") and shutil.which("objdump")),
                    reason="needs binutils (as, objdump) to assemble and disassemble an object")
def test_objdump_mnemonics(tmp_path):
    src = tmp_path / "k.s"
    src.write_text(".text\nf:\n vpmullq %zmm1, %zmm2, %zmm3\n vp2intersectd %zmm1, %zmm2, %k2\n"
                   " bzhi %eax, %ebx, %ecx\n ret\n")
    obj = tmp_path / "k.o"
    subprocess.run(["as", "-o", str(obj), str(src)], check=True)
    used = host_flags.mnemonics([str(obj)])
    assert {"vpmullq", "vp2intersectd", "bzhi", "ret"} <= used
    assert "avx512_vp2intersect" in host_flags.needed(EPYC, used)

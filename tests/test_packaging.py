"""Packaging: extras and install hints agree, one version source, shipped files, the
preprocess chosen by the backend registry, and ``lower/`` free of kernel imports.

The resolution of the GPU extras against the package index (``[cuda]`` brings a JAX CUDA
plugin and no torch) needs the network: ``scripts/check_install.sh`` does it, and
:func:`test_gpu_extras_resolve` runs that script when ``JCOMPILEMASK_CHECK_INSTALL=1``.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib

import jcompilemask as jcm
from jcompilemask import _install, backends

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jcompilemask"


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _req_name(req: str) -> str:
    return re.split(r"[\[<>=~!; ]", req, maxsplit=1)[0].lower()


def test_hint_extras_are_the_pyproject_extras(pyproject):
    extras = pyproject["project"]["optional-dependencies"]
    assert set(_install.EXTRAS) == set(extras)
    for module, (dist, extra) in _install.MODULES.items():
        assert dist in {_req_name(r) for r in extras[extra]}, (module, dist, extra)
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        _install.pip_hint("gpu")


def test_every_named_extra_exists(pyproject):
    """Every ``jcompilemask[...]`` or ``.[...]`` written in the package, the README, the
    scripts and the Makefile names extras that pyproject defines."""
    extras = set(pyproject["project"]["optional-dependencies"])
    files = [*PKG.rglob("*.py"), *PKG.rglob("*.md"), ROOT / "README.md", ROOT / "Makefile",
             *(ROOT / "scripts").glob("*.sh"), *(ROOT / "docs").glob("*.md")]
    seen = 0
    for f in files:
        for m in re.finditer(r"(?:jcompilemask|\.)\[([a-z0-9_,\-]+)\]", f.read_text()):
            for e in m.group(1).split(","):
                assert e in extras, f"{f.relative_to(ROOT)} names extra {e!r}"
                seen += 1
    # env.sh passes extras as "$root[$extra]": the Makefile's names are checked here.
    for m in re.finditer(r"source scripts/env\.sh ([a-z,]+)", (ROOT / "Makefile").read_text()):
        for e in m.group(1).split(","):
            assert e in extras, f"Makefile installs extra {e!r}"
            seen += 1
    assert seen


def test_install_hints_come_from_one_place():
    """Outside ``_install.py`` the package spells no pip command of its own."""
    for f in PKG.rglob("*.py"):
        if f.name == "_install.py":
            continue
        assert "pip install" not in f.read_text(), f"{f.relative_to(ROOT)}: use _install"


def test_cuda_extra_has_a_jax_plugin_and_no_torch(pyproject):
    extras = pyproject["project"]["optional-dependencies"]
    cuda = extras["cuda"]
    assert any(re.match(r"jax\[cuda1[23]", r) or _req_name(r).startswith("jax-cuda")
               for r in cuda), cuda
    names = {_req_name(r) for r in cuda}
    assert {"nvidia-cutlass-dsl", "apache-tvm-ffi", "jax-tvm-ffi"} <= names
    assert not names & {"tilelang", "torch"}
    assert "tilelang" in {_req_name(r) for r in extras["tilelang"]}


def test_exact_pins_say_why():
    """An ``==`` pin in pyproject's extras carries a comment (on its line or just above)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    start = lines.index("[project.optional-dependencies]")
    for i, line in enumerate(lines[start:], start):
        if line.startswith("[") and i > start:
            break
        if re.search(r'"[A-Za-z0-9_.\-\[\]]+==', line):
            assert "#" in line or lines[i - 1].strip().startswith("#"), line


def test_one_version_source(pyproject):
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "jcompilemask.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", jcm.__version__)
    assert jcm.__version__ in (ROOT / "CHANGELOG.md").read_text() or \
        "Unreleased" in (ROOT / "CHANGELOG.md").read_text()


def test_shipped_files(pyproject):
    p = pyproject["project"]
    assert p["requires-python"] == ">=3.11"
    assert p["license"] == "Apache-2.0" and p["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (PKG / "py.typed").exists()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["jcompilemask"]
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in p["classifiers"])
    assert p["urls"]


def test_no_reference_to_a_missing_design_document():
    """Docstrings and the README point to files that ship (``docs/``), not to a DESIGN.md."""
    for f in [*PKG.rglob("*.py"), ROOT / "README.md"]:
        assert "DESIGN" not in f.read_text(), f.relative_to(ROOT)
    for f in [*PKG.rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for ref in re.findall(r"docs/[\w\-]+\.md", f.read_text()):
            assert (ROOT / ref).exists(), f"{f.relative_to(ROOT)} -> {ref}"


# -- explain() and the hints on a machine without the GPU extras --------------------------
def test_explain_names_the_extra_to_install(monkeypatch):
    if backends._sm90_reason() is None:
        pytest.skip("an SM90 GPU is visible (the hints are for machines without one)")
    text = backends.explain()
    if _install.jax_cuda_plugin() is None:
        assert "JAX's CUDA plugin is not installed: pip install 'jcompilemask[cuda]'" in text
    assert re.search(r"tilelang: skipped: .*jcompilemask\[(cuda,)?tilelang\]", text) or \
        _install.missing("tilelang") == []
    assert "jnp: available" in text


def test_hints_on_a_gpu_machine_without_the_extras(monkeypatch):
    """What a GPU box with JAX's plugin but without the extras is told: [cuda] for the
    CuTe kernels, [tilelang] for the TileLang preprocess."""
    import jax
    monkeypatch.setattr(backends, "_sm90_reason", lambda: None)
    monkeypatch.setattr(backends, "missing", lambda *m: list(m))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cute = backends.get("cute").available()
    assert cute == ("nvidia-cutlass-dsl, jax-tvm-ffi are not installed "
                    "(pip install 'jcompilemask[cuda]')")
    tl = backends._tilelang_reason.__wrapped__()
    assert "pip install 'jcompilemask[cuda,tilelang]'" in tl and "jnp preprocess" in tl


def test_gpu_extras_missing_error_names_the_extra():
    from jcompilemask import ffi
    with pytest.raises(ffi.GpuExtrasMissing) as e:
        ffi.require_gpu_extras(("tilelang",) if _install.missing("tilelang") else
                               ("surely_not_a_module_jcm",))
    assert "[gpu]" not in str(e.value) and "pip install" in str(e.value)
    assert "jcompilemask[tilelang]" in _install.missing_hint("tilelang")
    assert _install.missing_hint("cutlass", "tilelang") == (
        "nvidia-cutlass-dsl, tilelang are not installed "
        "(pip install 'jcompilemask[cuda,tilelang]')")


# -- the registry chooses the preprocess ---------------------------------------------------
def test_instantiate_asks_the_registry(monkeypatch):
    monkeypatch.delenv(backends.PREPROCESS_ENV, raising=False)
    cm = jcm.compile(jcm.masks.causal())
    built = []

    def build(cm_, metadata, q_len, kv_len, tiles):
        built.append((q_len, kv_len, tiles))
        return backends.get_preprocess("jnp").build(cm_, metadata, q_len, kv_len, tiles)

    backends.register_preprocess(backends.Preprocess(
        name="probe", priority=100, available=lambda: None, supports=lambda cm: None,
        build=build))
    try:
        assert cm.default_preprocess() == "probe"
        d = cm.instantiate(None, 8, 8, block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
        assert built == [(8, 8, jcm.TileConfig(4, 4, 4, 4))]
        ref = cm.instantiate(None, 8, 8, block_q=4, block_kv=4, bwd_block_q=4,
                             bwd_block_kv=4, preprocess="jnp")
        assert (d.fwd_tiles == ref.fwd_tiles).all() and len(built) == 1
        assert "probe: available" in backends.explain()
    finally:
        backends._PREPROCESS.pop("probe")
    assert backends.select_preprocess(cm).name in ("jnp", "tilelang")


def test_preprocess_choice_and_errors(monkeypatch):
    monkeypatch.delenv(backends.PREPROCESS_ENV, raising=False)
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    causal = jcm.compile(jcm.masks.causal())
    fallback = jcm.compile(MaskSpec([Region((0, q_len), k * k <= q)]))
    assert fallback.fallback_regions
    # masks with fallback regions take jnp whatever the machine
    assert backends.select_preprocess(fallback).name == "jnp"
    with pytest.raises(ValueError, match="preprocess='tilelang' cannot serve this mask"):
        fallback.instantiate(None, 8, preprocess="tilelang")
    with pytest.raises(ValueError, match=r"preprocess must be one of \['jnp', 'tilelang'\]"):
        causal.instantiate(None, 8, preprocess="nope")
    monkeypatch.setenv(backends.PREPROCESS_ENV, "jnp")
    assert causal.default_preprocess() == "jnp"
    assert f"${backends.PREPROCESS_ENV}=jnp overrides" in backends.explain()
    if backends._tilelang_reason() is not None:
        monkeypatch.delenv(backends.PREPROCESS_ENV)
        assert causal.default_preprocess() == "jnp"


# -- lower/ imports nothing of kernels/, ffi/ or the registry ------------------------------
def _imports(path: pathlib.Path) -> list[str]:
    """Absolute names of every module ``path`` imports (at any depth of the code)."""
    mod = "jcompilemask.lower." + path.stem
    pkg = mod.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base) + ("." + node.module if node.module else "")
            else:
                prefix = node.module
            names += [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return names


def test_lower_imports_no_kernels_ffi_or_backends():
    forbidden = ("jcompilemask.kernels", "jcompilemask.ffi", "jcompilemask.backends")
    files = sorted((PKG / "lower").glob("*.py"))
    assert files
    for f in files:
        names = _imports(f)
        bad = [n for n in names if n.startswith(forbidden) or n.startswith("..")]
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
    # the resolver itself: a relative import two levels up resolves outside lower/
    assert "jcompilemask.spec.maskspec" in _imports(PKG / "lower" / "compiled.py")


# -- the network check of the extras (opt-in) ---------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JCOMPILEMASK_CHECK_INSTALL") != "1",
                    reason="resolves against the package index (set JCOMPILEMASK_CHECK_INSTALL=1)")
def test_gpu_extras_resolve():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "check_install.sh")],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check_install: ok" in r.stdout

"""The CuTe kernels' disk-cache fingerprint (``api._package_fingerprint``): it covers every
source a kernel's trace runs, and leaves out api.py's host-only functions (the registry's
policy, the JAX wrappers, the schedules), so an edit there keeps cached kernels while an
edit to anything a kernel runs compiles afresh. CPU only (no cutlass: nothing is traced).
"""
from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from pathlib import Path

import pytest

from jcompilemask.kernels.cute import api

ROOT = Path(api.__file__).resolve().parents[2]


def _read(path):
    f = ROOT / path
    return f.read_text() if f.is_file() else None


def _fingerprint(read):
    h = hashlib.sha256()
    for path, text in sorted(api._kernel_sources(read).items()):
        h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:24]


def _edited(path, old, new):
    """A reader that sees ``path`` with ``old`` replaced by ``new`` (once, must exist)."""
    text = _read(path)
    assert text.count(old) >= 1, (path, old)
    changed = text.replace(old, new, 1)
    ast.parse(changed)                  # still Python
    return lambda p: changed if p == path else _read(p)


def _names(code):
    """Every identifier of a _code_only text (a call, an attribute, an import; no strings)."""
    return {t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type == tokenize.NAME}


def test_the_fingerprint_is_the_hash_of_the_kernel_sources():
    assert api._package_fingerprint() == _fingerprint(_read)


def test_host_only_names_are_top_level_functions_of_api():
    tree = ast.parse(_read("kernels/cute/api.py"))
    functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert api._HOST_ONLY <= functions, sorted(api._HOST_ONLY - functions)


def test_nothing_a_kernel_runs_names_a_host_only_function():
    """The left-out functions are unreachable from the kept sources: no kept line (api.py's
    kernel half, the kernel modules, the residual programs and their imports) refers to
    one by name, as a call, an attribute or an import."""
    sources = api._kernel_sources(_read)
    for path, text in sources.items():
        hit = _names(text) & api._HOST_ONLY
        assert not hit, f"{path} names host-only {sorted(hit)}: drop them from api._HOST_ONLY"


def test_the_kernel_sources_hold_the_kernel_modules_and_their_imports():
    sources = set(api._kernel_sources(_read))
    for path in ("kernels/cute/forward.py", "kernels/cute/backward.py", "kernels/cute/common.py",
                 "kernels/cute/exp2_fma.py", "kernels/cute/residual_ops.py",
                 "kernels/cute/limits.py", "kernels/cute/api.py",
                 "lower/residual_program.py", "spec/expr.py", "spec/metadata.py"):
        assert path in sources
    for path in ("kernels/cute/testing.py", "attention/__init__.py", "flax/__init__.py",
                 "lower/preprocess.py"):
        assert path not in sources
    kept = api._kernel_sources(_read)["kernels/cute/api.py"]
    assert "def compile_backward(" in kept and "class BackwardConfig" in kept
    assert "def preferred_backward_config(" not in kept and "def cute_forward(" not in kept


@pytest.mark.parametrize("path, old, new", [
    # prose in the kernel sources: a comment, a docstring, blank lines
    ("kernels/cute/backward.py", "import enum", "import enum  # edited"),
    ("kernels/cute/common.py", "from __future__", "# edited\n\n\nfrom __future__"),
    ("kernels/cute/api.py", "\nclass BackwardConfig:\n    \"\"\"", "\nclass BackwardConfig:\n    \"\"\"Edited. "),
    ("lower/residual_program.py", "import dataclasses", "import dataclasses  # edited"),
    # the registry's policy: a config choice, its comment, a wrapper's body
    ("kernels/cute/api.py", "    if head_dim == 192:\n", "    if head_dim == 192:  # edited\n"),
    ("kernels/cute/api.py", "def cute_backward(", "def cute_backward(  # edited\n        "),
    ("kernels/cute/api.py", "def forward_schedule(", "def forward_schedule(  # edited\n        "),
    # a file no kernel imports
    ("kernels/cute/testing.py", '"""', '"""edited '),
])
def test_host_edits_keep_the_fingerprint(path, old, new):
    assert _fingerprint(_edited(path, old, new)) == _fingerprint(_read)


@pytest.mark.parametrize("path, old, new", [
    ("kernels/cute/api.py", "def compile_backward(key: BackwardKey", "def compile_backward(key: BackwardKey, _e=0"),
    ("kernels/cute/api.py", "    head_dim: int\n", "    head_dim: int\n    EDITED = 1\n"),
    ("kernels/cute/api.py", "def dq_warpgroups(head_dim: int", "def dq_warpgroups(head_dim: int, _e: int = 0"),
    ("kernels/cute/backward.py", "import enum", "import enum, os"),
    ("kernels/cute/common.py", "from __future__ import annotations", "from __future__ import annotations\nEDITED = 1"),
    ("lower/residual_program.py", "import dataclasses", "import dataclasses, os"),
    ("spec/expr.py", "from __future__ import annotations\n", "from __future__ import annotations\nEDITED = 1\n"),
    # a string that is not a docstring, and a '#' inside one, are code
    ("kernels/cute/api.py", '_EXPORTED = "jcm_kernel"', '_EXPORTED = "jcm_kernel # x"'),
])
def test_kernel_edits_change_the_fingerprint(path, old, new):
    assert _fingerprint(_edited(path, old, new)) != _fingerprint(_read)


def test_a_new_module_a_kernel_imports_joins_the_sources():
    extra = "kernels/cute/extra_ops.py"

    def read(path):
        if path == extra:
            return "X = 1\n"
        if path == "kernels/cute/common.py":
            return "from .extra_ops import X\n" + _read(path)
        return _read(path)

    assert extra in api._kernel_sources(read)
    edited = lambda p: "X = 2\n" if p == extra else read(p)  # noqa: E731
    assert _fingerprint(edited) != _fingerprint(read)


def test_code_only_cuts_comments_and_docstrings_only():
    text = "\n".join([
        '"""Module doc."""',
        "import os  # why",
        "",
        "",
        "class A:",
        '    """Doc."""',
        '    x = "# not a comment"',
        "",
        "    def f(self):",
        '        """Doc',
        '        two."""',
        '        return "s"  # tail',
        ""])
    assert api._code_only(text) == "\n".join([
        "import os",
        "class A:",
        '    x = "# not a comment"',
        "    def f(self):",
        '        return "s"'])


def test_the_preprocess_kernel_has_a_fingerprint_of_its_own():
    """glue.py (the backward preprocess) is not in the attention kernels' sources, nor they
    in its: an edit to either recompiles only its own kernels."""
    glue = ("kernels/cute/glue.py",)
    assert "kernels/cute/glue.py" not in api._kernel_sources(_read)
    assert set(api._kernel_sources(_read, glue)) == {"kernels/cute/glue.py"}
    assert api._glue_fingerprint() == api._sources_fingerprint(glue)
    bwd = _edited("kernels/cute/backward.py", "import enum", "import enum, os")
    assert api._kernel_sources(bwd, glue) == api._kernel_sources(_read, glue)
    edited = _edited("kernels/cute/glue.py", "import math", "import math, os")
    assert api._kernel_sources(edited, glue) != api._kernel_sources(_read, glue)
    assert _fingerprint(edited) == _fingerprint(_read)

"""A static check of the CuTe kernels' sources for one class of bug the DSL does not report.

The CuTe DSL turns a dynamic ``for`` (``cutlass.range``) or ``if`` into an MLIR region and
carries a Python variable out of it only when the region assigns the name or calls a method
on it directly (its preprocessor's region analysis; a call whose base is ``self`` marks
nothing). A pipeline state handed to a helper method that advances it, inside such a region,
therefore leaves the region at its entry value unless the caller assigns what the helper
returns: the forward's ``k_ahead`` producer did exactly that and every K / V of a row went to
one ring stage (an H200 launch failure). The kernels' convention is
``state = self.helper(..., state, ...)``; this test checks every call site keeps it.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "jcompilemask" / "kernels" / "cute"
SOURCES = ("forward.py", "backward.py", "common.py")


def _is_constexpr_if(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Call) and isinstance(t.func, (ast.Name, ast.Attribute))
            and getattr(t.func, "id", getattr(t.func, "attr", None)) == "const_expr")


def _is_dynamic_for(node: ast.For) -> bool:
    it = node.iter
    return (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
            and it.func.attr == "range" and not it.func.attr.endswith("constexpr"))


def _advanced_params(func: ast.FunctionDef) -> set[int]:
    """Positions (0 = first after self) of the parameters ``func`` calls ``.advance()`` on."""
    names = [a.arg for a in func.args.args[1:]]
    hit = set()
    for n in ast.walk(func):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "advance" and isinstance(n.func.value, ast.Name)
                and n.func.value.id in names):
            hit.add(names.index(n.func.value.id))
    return hit


def _targets(stmt) -> set[str]:
    out = set()
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        tgts = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for t in tgts:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    out.add(n.id)
    return out


def problems(source: str, filename: str = "<src>") -> list[str]:
    """Call sites inside dynamic regions that pass a name to a method advancing it without
    assigning the name from the call's result."""
    tree = ast.parse(source)
    methods = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for f in cls.body:
            if isinstance(f, ast.FunctionDef):
                methods[f.name] = _advanced_params(f)
    found = []

    compound = (ast.For, ast.If, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)

    def check(st, exprs):
        """The calls in ``exprs`` (a simple statement, or a compound one's header)."""
        for e in exprs:
            for call in [n for n in ast.walk(e) if isinstance(n, ast.Call)]:
                f = call.func
                if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                        and f.value.id == "self" and methods.get(f.attr)):
                    continue
                assigned = _targets(st)
                for pos in sorted(methods[f.attr]):
                    if pos < len(call.args) and isinstance(call.args[pos], ast.Name):
                        name = call.args[pos].id
                        if name not in assigned:
                            found.append(f"{filename}:{call.lineno}: self.{f.attr}(...) "
                                         f"advances {name!r} inside a dynamic region; "
                                         f"assign it from the call's result")

    def visit(stmts, dynamic):
        for st in stmts:
            if dynamic:
                if not isinstance(st, compound):
                    check(st, [st])
                elif isinstance(st, (ast.If, ast.While)):
                    check(st, [st.test])
                elif isinstance(st, ast.For):
                    check(st, [st.iter])
            if isinstance(st, ast.For):
                visit(st.body, dynamic or _is_dynamic_for(st))
                visit(st.orelse, dynamic)
            elif isinstance(st, ast.If):
                inner = dynamic or not _is_constexpr_if(st)
                visit(st.body, inner)
                visit(st.orelse, inner)
            elif isinstance(st, ast.While):
                visit(st.body, True)
            elif isinstance(st, (ast.FunctionDef, ast.ClassDef)):
                visit(st.body, False)
            elif isinstance(st, (ast.With, ast.Try)):
                visit(st.body, dynamic)
    visit(tree.body, False)
    return found


@pytest.mark.parametrize("name", SOURCES)
def test_states_advanced_by_helpers_are_carried(name):
    path = KERNELS / name
    assert not problems(path.read_text(), name)


def test_the_check_finds_the_k_ahead_bug():
    """The shape of the bug this guards against, and of its fix."""
    bad = '''
class K:
    def helper(self, a, state, b):
        if const_expr(a):
            state.advance()
        return b

    def loop(self, n, state, prev):
        for i in cutlass.range(n, unroll=1):
            if prev >= 0:
                prev = self.helper(True, state, prev)
        return state
'''
    got = problems(bad)
    assert len(got) == 1 and "advances 'state'" in got[0]
    good = bad.replace("prev = self.helper(True, state, prev)",
                       "prev, state = self.helper(True, state, prev)")
    assert problems(good) == []
    constexpr_only = bad.replace("for i in cutlass.range(n, unroll=1):\n            if prev >= 0:",
                                 "for i in cutlass.range_constexpr(4):\n            if const_expr(prev):")
    assert problems(constexpr_only) == []

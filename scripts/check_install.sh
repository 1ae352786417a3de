#!/usr/bin/env bash
# Resolves the GPU extras in a fresh venv without installing anything (pip --dry-run; needs
# the package index, no GPU): `[cuda]` must bring a JAX CUDA plugin and no torch,
# `[cuda,tilelang]` must resolve too.
# Usage: scripts/check_install.sh [python]   (default: python3.12, or pyenv's 3.12)
# tests/test_packaging.py runs it when JCOMPILEMASK_CHECK_INSTALL=1.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=(${1:-})
if [[ ${#py[@]} -eq 0 ]]; then
  if python3.12 -c '' >/dev/null 2>&1; then py=(python3.12)
  elif command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -1 || true)
    [[ -n $v ]] && py=(env PYENV_VERSION="$v" python3)
  fi
fi
[[ ${#py[@]} -gt 0 ]] || { echo "check_install.sh: needs Python 3.12" >&2; exit 2; }
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"${py[@]}" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
fail=0
resolve() {  # resolve EXTRAS -> the "Would install" line
  "${pip[@]}" install --dry-run --ignore-installed "$root[$1]" 2>&1 | tee "$venv/log-$1" \
    | grep '^Would install' || { tail -20 "$venv/log-$1" >&2; echo "[$1] did not resolve" >&2; return 1; }
}
line=$(resolve cuda) || fail=1
echo "[cuda] $line"
if [[ $line != *jax-cuda13-plugin* && $line != *jax-cuda12-plugin* ]]; then
  echo "FAIL: [cuda] brings no JAX CUDA plugin" >&2; fail=1
fi
if [[ " $line " == *" torch-"* ]]; then echo "FAIL: [cuda] brings torch" >&2; fail=1; fi
line=$(resolve cuda,tilelang) || fail=1
echo "[cuda,tilelang] $line"
if [[ $line != *tilelang-* ]]; then echo "FAIL: [cuda,tilelang] brings no tilelang" >&2; fail=1; fi
[[ $fail -eq 0 ]] && echo "check_install: ok"
exit $fail

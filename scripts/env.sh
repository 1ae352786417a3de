#!/usr/bin/env bash
# Creates (once) and activates the project's venv. Prefers Python 3.12 (the device's
# generation: jax 0.11.2 needs >= 3.11 on PyPI wheels, and pip on 3.11 stops at jax 0.10).
# Installs the package (editable) with the given extras, again only when pyproject.toml
# changed. Usage: source scripts/env.sh [extras]   e.g. `source scripts/env.sh test`
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${JCM_VENV:-$root/.venv}
runs() { "$@" -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1; }
if [[ ! -x $venv/bin/python ]]; then
  py=()
  for cand in python3.12 python3.13; do
    if runs "$cand"; then py=("$cand"); break; fi
  done
  if [[ ${#py[@]} -eq 0 ]] && command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -1 || true)
    if [[ -n $v ]] && runs env PYENV_VERSION="$v" python3; then py=(env PYENV_VERSION="$v" python3); fi
  fi
  if [[ ${#py[@]} -eq 0 ]] && runs python3; then py=(python3); fi
  [[ ${#py[@]} -gt 0 ]] || { echo "scripts/env.sh: need Python >= 3.11" >&2; exit 1; }
  "${py[@]}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
if "$venv/bin/python" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
  jaxpin="jax[cpu]==0.11.2"          # what the H200 image runs
else
  jaxpin="jax[cpu]>=0.10"
fi
extra=${1:-}
spec="$root"; [[ -n $extra ]] && spec="$root[$extra]"
# The install is editable, so only a change of pyproject.toml (dependencies, extras) needs
# pip again: a stamp per extra holds the hash of what was installed.
stamp="$venv/.jcompilemask-installed-${extra:-base}"
want=$( { cat "$root/pyproject.toml"; echo "$spec $jaxpin"; } | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  "$venv/bin/python" -m pip install -q -e "$spec" "$jaxpin"
  echo "$want" > "$stamp"
fi
export PATH=$venv/bin:$PATH

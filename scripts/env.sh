#!/usr/bin/env bash
# Creates (once) and activates the project's venv with Python 3.12 when this machine has it
# (jax >= 0.11, the device's generation, needs 3.11+; pip on 3.11 stops at jax 0.10).
# Usage: source scripts/env.sh [extra]   e.g. `source scripts/env.sh test`
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${JCM_VENV:-$root/.venv}
if [[ ! -x $venv/bin/python ]]; then
  py=""
  for cand in python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
      py=$cand; break
    fi
  done
  if [[ -z $py ]] && command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.12' | tail -1 || true)
    [[ -n $v ]] && py="env PYENV_VERSION=$v python3"
  fi
  [[ -n $py ]] || { echo "need Python >= 3.11" >&2; exit 1; }
  $py -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
extra=${1:-}
spec="$root"; [[ -n $extra ]] && spec="$root[$extra]"
"$venv/bin/python" -m pip install -q -e "$spec" "jax[cpu]==0.11.2" 2>&1 | grep -v '^WARNING' || true
export PATH=$venv/bin:$PATH

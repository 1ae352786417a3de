#!/usr/bin/env bash
# A CPU twin of the H200 machine's Python, for compiling the CuTe kernels a device call will
# need before the call (scripts/kernel_cache.sh): Python 3.12, jax 0.11.2 (CPU here), and the
# packages of the device bundle (.device-stage/cute, ../shared/device/make-bundles) unpacked
# the way its install.py unpacks them there. The kernels' disk-cache key names the
# versions of cutlass-dsl's distributions (api.disk_cache_key), so a kernel compiled in this
# env is found by the device's processes, and one compiled in the project's .venv (which
# also holds nvidia-cutlass-dsl-libs-cu12) is not. The repo is imported from PYTHONPATH, as
# h200.sh does there.
#
#   source scripts/device_env.sh     # sets JCM_DEVICE_PY (the env's python), creates it once
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
env_dir=${JCM_DEVICE_ENV:-$HOME/.cache/jcm-device-env}
bundle=$root/.device-stage/cute/cute.tar.xz
[[ -f $bundle ]] || { echo "device_env.sh: no $bundle (run ../shared/device/make-bundles first)" >&2; return 1 2>/dev/null || exit 1; }
if [[ ! -x $env_dir/bin/python ]]; then
  py=(python3.12)
  "${py[@]}" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 \
    || py=(env PYENV_VERSION=3.12.1 python3)
  "${py[@]}" -m venv "$env_dir" || { echo "device_env.sh: no Python 3.12" >&2; return 1 2>/dev/null || exit 1; }
  "$env_dir/bin/python" -m pip install -q --upgrade pip
fi
# What the device image has besides the bundle (the versions of these are not in any key).
stamp=$env_dir/.base-installed
if [[ ! -f $stamp ]]; then
  "$env_dir/bin/python" -m pip install -q "jax[cpu]==0.11.2" flax sympy numpy cuda-bindings \
    pytest hypothesis pytest-xdist
  touch "$stamp"
fi
# The bundle, unpacked as install.py does on the device (a .pth for its site, and the
# packages' own .pth files), again whenever the bundle changes.
want=$(sha256sum "$bundle" | cut -c1-16)
if [[ ! -f $env_dir/.bundle || $(cat "$env_dir/.bundle") != "$want" ]]; then
  rm -rf "$env_dir/site"; mkdir -p "$env_dir/site"
  tar -xJf "$bundle" -C "$env_dir/site"
  sp=$("$env_dir/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$env_dir/site" > "$sp/aa_device_stage.pth"
  rm -f "$sp"/zz_*.pth
  for p in "$env_dir"/site/*.pth; do [[ -f $p ]] && cp "$p" "$sp/zz_$(basename "$p")"; done
  echo "$want" > "$env_dir/.bundle"
fi
export JCM_DEVICE_PY=$env_dir/bin/python

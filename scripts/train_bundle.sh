#!/usr/bin/env bash
# Build .device-stage/train/: the pure-Python packages benchmarks/train_e2e.py needs beyond
# the cute bundle (flax, optax and what `from flax import nnx; import optax` imports),
# copied from this machine's environment, plus the install.py that makes them importable
# on the device machine (which reaches no package index). `bash scripts/h200.sh train`
# runs that install.py; carry both bundles:
#
#   bash scripts/train_bundle.sh
#   run(command="bash scripts/h200.sh train", carry=[".device-stage/cute", ".device-stage/train"])
#
# msgpack and yaml ship C extensions for this Python; on another Python they use their
# pure-Python fallbacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=$($PY -c 'import flax, os; print(os.path.dirname(os.path.dirname(flax.__file__)))')
out=.device-stage/train
rm -rf "$out" && mkdir -p "$out"
pkgs=(flax optax absl msgpack rich treescope yaml typing_extensions.py)
( cd "$SITE" && tar --exclude='__pycache__' -cJf - "${pkgs[@]}" \
    $(ls -d flax-*.dist-info optax-*.dist-info absl_py-*.dist-info msgpack-*.dist-info \
      rich-*.dist-info treescope-*.dist-info pyyaml-*.dist-info typing_extensions-*.dist-info \
      2>/dev/null) ) > "$out/train.tar.xz"
cat > "$out/install.py" <<'PYEOF'
"""Run on the device machine: unpack train.tar.xz into /tmp/site-train and put it on
python3's path (after the packages the machine already has, so theirs win). Safe to
run again."""
import os, site, tarfile

here = os.path.dirname(os.path.abspath(__file__))
dst = "/tmp/site-train"
os.makedirs(dst, exist_ok=True)
with tarfile.open(os.path.join(here, "train.tar.xz"), "r:xz") as t:
    t.extractall(dst, filter="fully_trusted")
with open(os.path.join(site.getsitepackages()[0], "zzz_train_stage.pth"), "w") as f:
    f.write(dst + "\n")
print("train bundle importable from", dst)
PYEOF
ls -la "$out"

#!/usr/bin/env bash
# Builds the wheel from this checkout, installs it (not editable) into a
# fresh virtual environment and runs .ci/wheel_smoke.py there, outside the
# source tree: a file the package reads at run time but the wheel leaves
# out fails here.  The dependencies come from .venv (`make` creates it):
# the fresh environment sees its site-packages through a .pth file, so
# nothing is downloaded but the build backend.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip wheel -q --no-deps -w "$tmp/dist" .
base=$($PY -c 'import sys; print(sys.base_prefix)')/bin/python3
"$base" -m venv --without-pip "$tmp/env"
deps=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$tmp/env/bin/python" -c \
  'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$deps" > "$site/jaxflash-deps.pth"
$PY -m pip --python "$tmp/env/bin/python" install -q --no-deps \
  "$tmp"/dist/jaxflash-*.whl
(cd "$tmp" && "$tmp/env/bin/python" "$OLDPWD/.ci/wheel_smoke.py")

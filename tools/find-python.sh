#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, or explains and fails.
# Looks on PATH first, then in pyenv's installed versions.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
for c in "${PYTHON:-}" python3.12 python3.13 python3.14 python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then "$p" -c 'import sys; print(sys.executable)'; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  # Oldest first: 3.12 is what the GPU machine runs.
  for ver in $(pyenv versions --bare 2>/dev/null | sort -V); do
    p="$root/versions/$ver/bin/python3"
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "jaxflash needs Python >= 3.12 (jax 0.11.2 requires it): none found on" \
     "PATH or through pyenv. Install one, or set PYTHON=/path/to/python3.12." >&2
exit 1

#!/usr/bin/env bash
# SASS of a Mosaic GPU kernel, disassembled here rather than on the GPU
# machine (there, Mosaic's MOSAIC_GPU_DUMP_SASS=1 could not start nvdisasm
# on 2026-12-01: "Process spawn failed", even with its folder on PATH).
#
#   device: MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$OUT/ptx python3 ...
#           (one process per kernel; tar the folder into $OUT: a call
#           returns few files)
#   here:   bash tools/sass_from_ptx.sh KERNEL.ptx > KERNEL.sass
#
# ptxas must accept the PTX's .version (9.0 from jax 0.11.2: CUDA 13's
# ptxas; PTXAS=/path/to/ptxas, default the one on PATH).  cuobjdump and
# nvdisasm come from NVIDIA's wheels (pip download, cached in
# $SASS_TOOLS).  The register count ptxas prints here matched the GPU
# machine's for the forward kernels compared (168; tokamax's 48-byte
# spill too).
set -eu
ptx=${1:?usage: sass_from_ptx.sh KERNEL.ptx}
tools=${SASS_TOOLS:-$HOME/.cache/jaxflash-sass}
ptxas=${PTXAS:-ptxas}
if [ ! -x "$tools/bin/cuobjdump" ] || [ ! -x "$tools/bin/nvdisasm" ]; then
  mkdir -p "$tools/whl" "$tools/bin"
  python3 -m pip download -q --no-deps -d "$tools/whl" \
    nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
  for w in "$tools"/whl/*.whl; do
    python3 -m zipfile -e "$w" "$tools/x"
  done
  for b in cuobjdump nvdisasm; do
    f=$(find "$tools/x" -name "$b" -type f | head -1)
    cp "$f" "$tools/bin/$b" && chmod +x "$tools/bin/$b"
  done
fi
cubin=$(mktemp --suffix=.cubin)
trap 'rm -f "$cubin"' EXIT
"$ptxas" -arch=sm_90a -O3 -v "$ptx" -o "$cubin" >&2
PATH="$tools/bin:$PATH" cuobjdump -sass "$cubin"

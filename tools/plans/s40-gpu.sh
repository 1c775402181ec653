# s40's call (about 500 s on an H200; on an H100 it stops at once):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s40-gpu.sh
# On an H200: the whole forward grid (7 rounds), head_dim 64 with three
# consumers (the H100's rules since s39) alongside, on the plain grid
# (w3) and the persistent one (w3p).  (At d6a7c2d its H100 branch timed
# head_dim 128 non-causal at 4096-16384 keys, the 128-key form against
# the 176-key form: level.)
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
if nvidia-smi -L | grep -q H200; then
  bench_stage grid-d64 240 --impls $I --mode fwd --head-dims 64 \
    --causal both --samples 7 \
    --mosaic-variants "w3:compute_wgs=3;w3p:compute_wgs=3,persistent=1"
  bench_stage grid-d128 125 --impls $I --mode fwd --head-dims 128 \
    --causal both --samples 7
  bench_stage grid-d256 125 --impls $I --mode fwd --head-dims 256 \
    --causal both --samples 7
else
  echo "not an H200: nothing to run (s40 ran the H100 branch at d6a7c2d)"
fi

# s40's call (about 500 s on an H200, 120 s on an H100):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s40-gpu.sh
# On an H200: the whole forward grid (7 rounds), head_dim 64 with three
# consumers (the H100's rules since s39) alongside, on the plain grid
# (w3) and the persistent one (w3p).  On an H100: head_dim 128
# non-causal at 4096-16384 keys, the 128-key form (the H200 entry's up
# to 8191 keys) against the 176-key form (from 8192), both ways.
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
  K128="block_kv=128,intra_wg_overlap=1,consumer_registers=240"
  K128="$K128,lean_epilogue=1,early_q_release=1"
  K176="block_kv=176,intra_wg_overlap=0,consumer_registers=none"
  K176="$K176,lean_epilogue=0,early_q_release=0"
  bench_stage d128nc-kv 150 --impls $I --mode fwd --head-dims 128 \
    --seqs 4096,8192,16384 --causal off --samples 9 \
    --mosaic-variants "k128:$K128;k176:$K176"
fi

# On an H200 (s39's next step), about 200 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s40-h200.sh
# Three head_dim 64 consumers (the H100's rules since s39) against the
# H200 entry's default at 1024-16384 keys, causal and not, with the
# persistent grid alongside (w3p; for causal calls from 4097 keys).
# On an H100 it stops at once (the H100 ran these in s39).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
if nvidia-smi -L | grep -q H200; then
  bench_stage d64-w3-h200 220 --impls $I --mode fwd --head-dims 64 \
    --seqs 1024,2048,4096,8192,16384 --causal both --samples 7 \
    --mosaic-variants "x:stages=2;w3:compute_wgs=3;w3p:compute_wgs=3,persistent=1"
else
  echo "not an H200: nothing to do (s39 ran these on an H100)"
fi

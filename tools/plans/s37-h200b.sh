# An H200 call (s37), about 560 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200b.sh
# The forward grid at head_dim 64 and 256 (every key length, causal and
# not, 7 rounds; jaxflash's defaults, cuDNN and tokamax in one run per
# head_dim) at the session's defaults; s37-h200c.sh has head_dim 128.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage grid-d64 280 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7
bench_stage grid-d256 280 --impls $I --mode fwd --head-dims 256 \
  --causal both --samples 7

# An H200 call (s37), about 250 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200c.sh
# The short calls (1024 and 2048 keys, all three head_dims, causal and
# not) sustained: 4 samples of at least 0.5 s, the card at its power cap
# (s37-h200b.sh has the grid in 20 ms rounds).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage short-sust 220 --impls $I --mode fwd --head-dims 64,128,256 \
  --seqs 1024,2048 --causal both --samples 4 --sample-seconds 0.5 --seed 1

# An H200 call (s37), about 300 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200c.sh
# The forward grid at head_dim 128 (7 rounds, as s37-h200b.sh), then the
# short calls (1024 and 2048 keys, all three head_dims, causal and not)
# sustained: 4 samples of at least 0.5 s, the card at its power cap.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage grid-d128 110 --impls $I --mode fwd --head-dims 128 \
  --causal both --samples 7
bench_stage short-sust 180 --impls $I --mode fwd --head-dims 64,128,256 \
  --seqs 1024,2048 --causal both --samples 4 --sample-seconds 0.5 --seed 1

# An H200 call (docs/perf-notes.md, "Next (thirty-sixth session's
# view)"), about 330 s, after s36-h200a.sh has run split_tail's gpu tests:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s36-h200c.sh
# split_tail at head_dim 64 and 256 (the persistent non-causal calls),
# and rtd at head_dim 64 non-causal (never timed there), each against a
# copy, in rounds and sustained.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
R="rescale_threshold=8,deferred_row_sum=1"
V="h200:stages=2;x:stages=2;st:split_tail=1;rtd:$R"
bench_stage d64-256nc-rounds 170 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64,256 --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "$V"
bench_stage d64-256nc-sust 150 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64,256 --seqs 1024,2048 --causal off --samples 4 \
  --sample-seconds 0.5 --seed 1 --mosaic-variants "$V"

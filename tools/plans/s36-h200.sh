# The next H200 call (docs/perf-notes.md, "Next (thirty-fifth session's
# view)" items 0 and 3), about 480 s of device time:
#   bash tools/gpu_session.sh stages tools/plans/s36-h200.sh
# (carry .whl; JAXFLASH_COMMIT=<commit>).  Variants start from the H200
# entry (--tuned-for), h200 = that entry, x = a copy of it.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
V="h200:stages=2;x:stages=2;io:item_overlap=1"
V="$V;dqio:q_double_buffer=1,item_overlap=1;dq:q_double_buffer=1"
V="$V;qkvp:q_l2_prefetch=1,kv_l2_prefetch=1;ls:late_store_wait=1"
R="rescale_threshold=8,deferred_row_sum=1"
bench_stage d128nc-rounds 150 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "$V"
bench_stage d128nc-sust 130 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 1024,2048 --causal off --samples 4 \
  --sample-seconds 0.5 --seed 1 --mosaic-variants "$V"
bench_stage d64-rtd 120 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 1024,2048,4096 --causal both --samples 7 \
  --mosaic-variants "h200:stages=2;x:stages=2;rtd:$R"

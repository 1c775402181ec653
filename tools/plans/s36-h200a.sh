# The next H200 call, first of four (docs/perf-notes.md, "Next
# (thirty-fifth session's view)" items 0 and 1), about 520 s of device
# time:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s36-h200a.sh
# (carry .whl).  split_tail's first GPU run (its gpu tests, then timed),
# and the item-boundary options at head_dim 128, never timed on the H200.
# Variants start from the H200 entry (--tuned-for): h200 = that entry,
# x = a copy of it; st = split_tail (nm: without the 1024-key call's
# clusters, which split_tail does not take).
test_stage split-tail-tests 150 tests/test_mosaic_gpu.py \
  -k "split_tail or split-tail"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
V="h200:stages=2;x:stages=2;st:split_tail=1;nm:kv_multicast=0"
V="$V;stnm:split_tail=1,kv_multicast=0;io:item_overlap=1"
V="$V;dqio:q_double_buffer=1,item_overlap=1;qkvp:q_l2_prefetch=1,kv_l2_prefetch=1"
V="$V;ls:late_store_wait=1"
bench_stage d128nc-rounds 170 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "$V"
bench_stage d128nc-sust 170 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 1024,2048 --causal off --samples 4 \
  --sample-seconds 0.5 --seed 1 --mosaic-variants "$V"

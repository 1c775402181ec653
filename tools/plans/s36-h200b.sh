# An H200 call (docs/perf-notes.md, "Next (thirty-sixth session's
# view)"), about 500 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s36-h200b.sh
# item_overlap's plain-loop form (s36: head_dim 64's default loop run on
# across work items, the epilogue under the next item's first Q K^T;
# never run on a GPU): its gpu tests (with the overlapped form's), then
# timed at head_dim 64 non-causal 1024/2048 keys, with one Q buffer (io)
# and two (iodq), against a copy, in rounds and sustained; then rtd at
# head_dim 64 causal (never timed there).  (At head_dim 256 the plain
# form spills 460/584 bytes on the CPU's ptxas: not timed there.)
test_stage item-overlap-tests 150 tests/test_mosaic_gpu.py \
  -k "item-overlap or item_overlap"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
R="rescale_threshold=8,deferred_row_sum=1"
V="h200:stages=2;x:stages=2;io:item_overlap=1"
V="$V;iodq:item_overlap=1,q_double_buffer=1;dq:q_double_buffer=1"
bench_stage d64nc-io-rounds 120 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "$V"
bench_stage d64nc-io-sust 110 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 1024,2048 --causal off --samples 4 \
  --sample-seconds 0.5 --seed 1 --mosaic-variants "$V"
bench_stage d64c-rtd 110 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 1024,2048,4096 --causal on --samples 7 \
  --mosaic-variants "h200:stages=2;x:stages=2;rtd:$R"

# An H200 call (s37), about 400 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200a.sh
# The item-start lever of s36 (q_double_buffer: +6.3% at head_dim 64
# non-causal 1024 keys) where it was never tried: head_dim 64 causal,
# whose persistent grid (the default up to 4096 keys) runs without the
# next Q prefetched since 2026-12-01 (ece69db: prefetch_q lost there, 266 against 282
# TFLOP/s at 1024 keys, before most of today's kernel); and head_dim 128
# non-causal 1024/2048 keys, where it was timed only with item_overlap.
# First their gpu tests (the causal ones new in s37), then each variant
# against a copy of the H200 entry in 9 rounds (a winner is timed
# sustained in the grid's call, s37-h200c.sh): pq = the next Q
# prefetched, pqdq = with two Q buffers, dq = two Q buffers (prefetch_q
# is on there).
test_stage double-q-tests 150 tests/test_mosaic_gpu.py \
  -k "persistent_causal_items or (test_gpu_long_persistent_items and double-q and not l2 and not overlap)"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
V="h200:stages=2;x:stages=2;pq:prefetch_q=1"
V="$V;pqdq:prefetch_q=1,q_double_buffer=1"
bench_stage d64c-rounds 150 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 1024,2048,4096 --causal on --samples 9 \
  --mosaic-variants "$V"
bench_stage d128nc-dq-rounds 110 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 128 --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "h200:stages=2;x:stages=2;dq:q_double_buffer=1"

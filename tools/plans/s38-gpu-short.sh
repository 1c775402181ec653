# A short call on an H200 or an H100 (s38), about 300 s, for what device
# time s38 had left:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu-short.sh
# (XDIST=4 on an H100.)  s38-gpu.sh's first two stages (the head_dim 64
# non-causal 1025-2048-key rule's gpu tests; the rule against the old
# default and a copy, with the causal 2048-key lever alongside), then
# the head_dim 64 forward grid (the only head_dim whose kernels changed
# since the s38 H100 grid at 3c947de).
test_stage d64nc-rule-tests 150 tests/test_mosaic_gpu.py \
  -k "test_gpu_long_persistent_default_items or (test_gpu_long and 64-False-2000) or (test_gpu_long_persistent_items and 64 and item-overlap) or d64-full-default"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64-rule 70 --impls $I --mode fwd --head-dims 64 \
  --seqs 2048 --causal both --samples 9 \
  --mosaic-variants "x:stages=2;old:item_overlap=0,q_double_buffer=0;pqdq:prefetch_q=1,q_double_buffer=1"
bench_stage grid-d64 100 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7

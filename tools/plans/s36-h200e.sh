# The H200 call that checks s36's head_dim 64 rule (q_double_buffer on
# non-causal calls of at most 1024 keys), about 420 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s36-h200e.sh
# the default-path gpu tests, then the new default against the old one
# (old: q_double_buffer=0) and a copy, head_dim 64 non-causal 1024/2048.
test_stage default-path 280 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "(test_gpu_long or (test_gpu and default) or segments_and_lengths or masks_gpu or deterministic or persistent-pairs) and not triton"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64nc-rule 110 --impls $I --mode fwd --head-dims 64 \
  --seqs 1024,2048 --causal off --samples 9 \
  --mosaic-variants "x:stages=2;old:q_double_buffer=0"

# An H200 call (s37), about 500 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200b.sh
# s37's head_dim 64 causal rule (prefetch_q with q_double_buffer up to
# 1024 keys; measured on an H100) against the old default (old) and a
# copy, on the H200; then the forward grid at head_dim 64 and 256 (every
# key length, causal and not, 7 rounds; jaxflash's defaults, cuDNN and
# tokamax in one run per head_dim; s37-h200c.sh has head_dim 128); then
# the default-path gpu tests.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64c-rule 80 --impls $I --mode fwd --head-dims 64 \
  --seqs 1024,2048 --causal on --samples 9 \
  --mosaic-variants "x:stages=2;old:prefetch_q=0,q_double_buffer=0"
bench_stage grid-d64 110 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7
bench_stage grid-d256 110 --impls $I --mode fwd --head-dims 256 \
  --causal both --samples 7
test_stage default-path 200 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "(test_gpu_long or (test_gpu and default) or segments_and_lengths or masks_gpu or deterministic or persistent-pairs) and not triton"

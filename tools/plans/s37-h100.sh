# An H100 call (s37), about 350 s (XDIST=4 on an H100's 78 GiB):
#   XDIST=4 JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h100.sh
# The gpu tests that run head_dim 64's defaults on calls of at most 1024
# keys (s37's causal rule: prefetch_q with q_double_buffer there), from
# the default-path selection; then the rule against the old default
# (old) and a copy at head_dim 64 causal 1024 keys; the head_dim 64
# forward grid.
test_stage d64-default-path 200 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "((test_gpu and default) or test_gpu_long or segments_and_lengths or masks_gpu or deterministic) and not triton and not 128 and not 256 and not 192 and not multicast and not persistent_items and not fa3 and not 8195 and not 4096 and not 2000"
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64c-rule 60 --impls $I --mode fwd --head-dims 64 \
  --seqs 1024 --causal on --samples 9 \
  --mosaic-variants "x:stages=2;old:prefetch_q=0,q_double_buffer=0"
bench_stage grid-d64 100 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7

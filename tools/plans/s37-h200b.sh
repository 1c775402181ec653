# An H200 call (s37), about 450 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s37-h200b.sh
# s37's head_dim 64 causal rule (prefetch_q with q_double_buffer up to
# 1024 keys; measured on an H100) against the old default (old) and a
# copy, on the H200; then the whole forward grid (every head_dim and key
# length, causal and not, 7 rounds; jaxflash's defaults, cuDNN and
# tokamax in one run per head_dim); then the gpu tests that run head_dim
# 64's defaults at up to 1024 keys (tools/plans/s37-h100.sh's selection).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
bench_stage d64c-rule 60 --impls $I --mode fwd --head-dims 64 \
  --seqs 1024 --causal on --samples 9 \
  --mosaic-variants "x:stages=2;old:prefetch_q=0,q_double_buffer=0"
for d in 64 128 256; do
  bench_stage grid-d$d 120 --impls $I --mode fwd --head-dims $d \
    --causal both --samples 7
done
test_stage d64-default-path 150 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "((test_gpu and default) or test_gpu_long or segments_and_lengths or masks_gpu or deterministic) and not triton and not 128 and not 256 and not 192 and not multicast and not persistent_items and not fa3 and not 8195 and not 4096 and not 2000"

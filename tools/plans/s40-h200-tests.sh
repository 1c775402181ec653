# s40, right after s40-gpu.sh on the same H200 (about 300 s): the
# default-path gpu tests (every head_dim's default forms, the long
# calls, masks, segments and lengths, determinism), as s36-h100.sh
# runs them, and the H100 forms' tests (which an H200 runs as well).
test_stage default-path 290 tests/test_mosaic_gpu.py \
  tests/test_mask_features.py tests/test_api.py tests/test_numerics.py \
  -k "(test_gpu_long or (test_gpu and default) or segments_and_lengths or masks_gpu or deterministic or persistent-pairs or test_gpu_h100_three_consumers) and not triton"

# The shortest call (s38, about 120 s): s38's head_dim 64 non-causal
# rule's gpu tests only (s38-gpu-short.sh's first stage).
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu-tests.sh
test_stage d64nc-rule-tests 150 tests/test_mosaic_gpu.py \
  -k "test_gpu_long_persistent_default_items or (test_gpu_long and 64-False-2000) or (test_gpu_long_persistent_items and 64 and item-overlap) or d64-full-default"

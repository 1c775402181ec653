# The shortest call (s38, about 120 s): s38's head_dim 64 non-causal
# rule's gpu tests (the default on 512 items at 1024/2000/2048 keys, the
# default path at 2000 keys, the item-overlap configs); the first stage
# of s38-gpu-short.sh and s38-gpu.sh.
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-gpu-tests.sh
test_stage d64nc-rule-tests 150 tests/test_mosaic_gpu.py \
  -k "test_gpu_long_persistent_default_items or (test_gpu_long and 64-False-2000) or (test_gpu_long_persistent_items and 64 and item-overlap) or d64-full-default"

# s40, after the H200 entry took three head_dim 64 consumers from 1024
# keys and the persistent grid on every causal call (about 200 s on an
# H200, 100 s on an H100): the gpu tests whose configs or shapes that
# changed, on either card; on an H200 then the head_dim 64 grid at the
# new defaults (s40-gpu.sh timed their kernels as its w3/w3p rows).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage d64-rule-tests 110 tests/test_mosaic_gpu.py -k "test_gpu_long_persistent_default_items or test_gpu_item_overlap_plain_chains or (test_gpu_split_tail and 64-) or (test_gpu_long_persistent_items and 64) or test_gpu_long_persistent_causal_items or test_gpu_h100_three_consumers"
if nvidia-smi -L | grep -q H200; then
  bench_stage grid-d64-new 120 --impls $I --mode fwd --head-dims 64 \
    --causal both --samples 7
fi

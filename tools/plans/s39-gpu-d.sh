# The fourth call of s39 (an H100), about 150 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s39-gpu-d.sh
# (XDIST=4 on an H100.)  The H100's head_dim 64 forms at this commit
# (three consumers from 1024 keys, every causal call persistent): their
# gpu tests, then the head_dim 64 forward grid with the H200 entry's
# default alongside (old, by --tuned-for).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage d64-rule-tests 200 tests/test_mosaic_gpu.py \
  -k "test_gpu_h100_three_consumers"
bench_stage grid-d64 200 --impls $I --mode fwd --head-dims 64 \
  --causal both --samples 7 --tuned-for "NVIDIA H200" \
  --mosaic-variants "old:stages=2"

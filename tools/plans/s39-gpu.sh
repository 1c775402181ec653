# A call on an H100 or an H200 (s39), about 300 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s39-gpu.sh
# (XDIST=4 on an H100.)  The H100's head_dim 64 rule (three consumers
# from 1024 keys, tuning.json's kind_kv_rules): its gpu tests and those
# of the H200's three-consumer default at 16384 keys; then on an H100
# the head_dim 64 forward grid with the H200 entry's default alongside
# (old, by --tuned-for); on an H200 (whose defaults the rule does not
# touch) the whole forward grid.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage d64-rule-tests 200 tests/test_mosaic_gpu.py \
  -k "test_gpu_h100_three_consumers or test_gpu_long_three_consumers"
if nvidia-smi -L | grep -q H200; then
  for d in 64 128 256; do
    bench_stage grid-d$d 120 --impls $I --mode fwd --head-dims $d \
      --causal both --samples 7
  done
else
  bench_stage grid-d64 200 --impls $I --mode fwd --head-dims 64 \
    --causal both --samples 7 --tuned-for "NVIDIA H200" \
    --mosaic-variants "old:stages=2"
fi

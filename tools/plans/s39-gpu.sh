# A call on an H100 or an H200 (s39), about 300 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s39-gpu.sh
# (XDIST=4 on an H100.)  The H100's head_dim 64 causal rule (three
# consumers from 4096 keys, tuning.json's kind_kv_rules): its gpu tests
# and those of the three-consumer default at 16384 keys, then the rule
# against the old default (old) and a copy (x) at 2048-8192 keys, with
# three consumers at 2048 (w3, the rule's lower edge) alongside.  On an
# H200 (whose defaults the rule does not touch) the head_dim 128 and 256
# forward grid instead of the rule's check (s38-gpu.sh's H200 half).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
test_stage d64c-rule-tests 200 tests/test_mosaic_gpu.py \
  -k "test_gpu_h100_causal_three_consumers or test_gpu_long_three_consumers or (test_gpu_long and 64-True-4096)"
if nvidia-smi -L | grep -q H200; then
  for d in 64 128 256; do
    bench_stage grid-d$d 120 --impls $I --mode fwd --head-dims $d \
      --causal both --samples 7
  done
else
  bench_stage d64c-rule 100 --impls $I --mode fwd --head-dims 64 \
    --seqs 2048,4096,8192 --causal on --samples 9 \
    --mosaic-variants "x:stages=2;old:compute_wgs=2;w3:compute_wgs=3"
fi

# An H200 call (s38), about 250 s:
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s38-h200d.sh
# The two head_dim 64 levers left at 2048 keys, on the H200, against a
# copy of the default (x), in rounds and sustained: non-causal with the
# loop run on across items and two Q buffers (iodq; s36: +2.3% rounds,
# +0.4% sustained), causal with the next Q prefetched into a second
# buffer (pqdq; s37 on an H100: +1.4% rounds, -0.5% sustained).
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
T="NVIDIA H200"
bench_stage d64nc-2048 70 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 2048 --causal off --samples 9 \
  --mosaic-variants "x:stages=2;iodq:item_overlap=1,q_double_buffer=1"
bench_stage d64c-2048 70 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 2048 --causal on --samples 9 \
  --mosaic-variants "x:stages=2;pqdq:prefetch_q=1,q_double_buffer=1"
bench_stage d64-2048-sust 100 --impls $I --mode fwd --tuned-for "$T" \
  --head-dims 64 --seqs 2048 --causal both --samples 4 \
  --sample-seconds 0.5 --seed 1 \
  --mosaic-variants "x:stages=2;iodq:item_overlap=1,q_double_buffer=1;pqdq:prefetch_q=1,q_double_buffer=1"

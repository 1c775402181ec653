# s40, after s40-st2.sh (about 90 s): split_tail at head_dim 128 with
# 2048 keys where the last wave is nearly empty (32768 tokens: 4096
# items, 31 waves and 4 items over 132 SMs) and where it is half full
# (16384 tokens: 2048 items, 68 left), to tell a cost of the split itself
# from one of the tail's many-part merges.
I=jaxflash-mosaic_gpu,cudnn,tokamax-mosaic
for t in 32768 16384; do
  bench_stage st-d128-t$t 60 --impls $I --mode fwd --head-dims 128 \
    --seqs 2048 --causal off --samples 9 --tokens $t \
    --mosaic-variants "st:split_tail=1"
done

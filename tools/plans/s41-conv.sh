# s41: issue 10's convergence comparison on one GPU (about 400 s):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s41-conv.sh
# gpt2-124m (head_dim 64, seq 2048), 300 steps, batch 8, one device:
# jaxflash and the XLA attention, seeds 0 and 1, the same data.  The
# runs write under /tmp (checkpoints, logs); the tables, the curves'
# JSON and the plot come back in logs.tgz.
t0=$SECONDS
timeout 560 python3 examples/gpt/convergence.py --preset gpt2-124m \
  --attention jaxflash,jax-xla --seeds 0,1 --steps 300 --batch 8 \
  --mesh data=1 --limit-bytes 8000000 --run-timeout 200 --out /tmp/conv \
  > "$out/logs/conv.log" 2>&1
echo "== conv rc=$? $((SECONDS - t0))s"
cp /tmp/conv/convergence.* "$out/logs/" 2>/dev/null
find /tmp/conv -name stderr.txt -exec sh -c \
  'tail -5 "$1" > "$2/logs/$(basename "$(dirname "$1")").stderr"' _ {} "$out" \;
cat "$out/logs/convergence.md" 2>/dev/null || tail -20 "$out/logs/conv.log"
pack

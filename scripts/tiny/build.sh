#!/usr/bin/env bash
# The whole recipe of the bundled `tiny` model, from ShareGPT to the package (CPU; resumable step by step).
#
#   bash scripts/tiny/build.sh            # WORK=runs/tiny by default
#
# 1. tokenizer + target from scratch          scripts/tiny/train_target.py (recipe.json)
# 2. English ShareGPT as JSONL                scripts/tiny/export_data.py
# 3. Clover-2 heads, self-distilled           clover train --regenerate (the target's own replies)
# 4. Medusa heads on the same data and steps  clover train --arch medusa (for comparison; not shipped)
# 5. evaluation on held-out prompts           scripts/tiny/evaluate.py -> docs/tiny_eval.json
# 6. fp16 weights into clover_cli/bundled     scripts/tiny/export.py
# 7. draft model, distilled from the bundled  scripts/tiny/train_draft.py (recipe.json "draft"), then
#    target on its regenerated replies         scripts/tiny/export_draft.py -> clover_cli/bundled/tiny/draft,
#                                              scripts/tiny/evaluate_draft.py -> docs/tiny_draft_eval.json
# 8. the n-gram drafter's prior: tri-gram     scripts/build_ngram_prior.py -> clover_cli/bundled/tiny/
#    counts of the bundled target's replies      clover-ngram.safetensors (400 training-split first turns)
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-runs/tiny}
CONVERSATIONS=${CONVERSATIONS:-1000}
CLOVER_STEPS=${CLOVER_STEPS:-1200}  # the shipped heads (a first 300-step run reached held-out τ 2.5; 1200: 3.4)
MEDUSA_STEPS=${MEDUSA_STEPS:-300}   # the comparison heads in docs/BENCHMARKS.md
HEADS_ARGS=(--data "$WORK/sharegpt_en.jsonl" --max-conversations "$CONVERSATIONS"
            --heads 5 --batch-tokens 4096 --max-len 1024 --lr 2e-3 --eval-every 200 --seed 0 --cache-features
            --regenerate --regen-turns 2 --draft-vocab 2048)

python scripts/tiny/train_target.py --work "$WORK"
python scripts/tiny/export_data.py --work "$WORK"
[ -f "$WORK/heads-clover/model.safetensors" ] ||
  clover train "$WORK/target" --out "$WORK/heads-clover" --arch clover --layers 1 --overwrite --max-steps "$CLOVER_STEPS" \
    "${HEADS_ARGS[@]}"
mkdir -p "$WORK/heads-medusa"
# the very same replies, with the marker that says what they were made from (without it they are made again)
cp "$WORK/heads-clover/regenerated.jsonl" "$WORK/heads-clover/clover-train.json" "$WORK/heads-medusa/"
[ -f "$WORK/heads-medusa/model.safetensors" ] ||
  clover train "$WORK/target" --out "$WORK/heads-medusa" --arch medusa --overwrite --max-steps "$MEDUSA_STEPS" "${HEADS_ARGS[@]}"
python scripts/tiny/evaluate.py --model "$WORK/target" --clover "$WORK/heads-clover" --medusa "$WORK/heads-medusa"
python scripts/tiny/export.py --work "$WORK"
# the draft model drafts for the shipped (fp16) target, so it is distilled from that one; one thread
python scripts/tiny/train_draft.py --work "$WORK" --regenerated "$WORK/heads-clover/regenerated.jsonl" \
  --sharegpt "$WORK/sharegpt_en.jsonl"
python scripts/tiny/export_draft.py --work "$WORK"
python scripts/tiny/evaluate_draft.py --work "$WORK"  # measures the exported (fp16) draft
python scripts/tiny/export_draft.py --work "$WORK"    # again, for the model card's numbers
python scripts/build_ngram_prior.py --conversations 400  # into clover_cli/bundled/tiny

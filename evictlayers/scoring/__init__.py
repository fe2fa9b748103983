"""How important a token is: accumulators over the attention mass each slot receives, over the
slots' keys, over the attention future queries are expected to pay or over the attention a reconstruction
of the context pays (probes), the softmax transform they score with, per-slot priors, and the refinements a
score goes through before ranking (pooling, chunks, the layer's heads)."""

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.averaged import Averaged
from evictlayers.scoring.chunk_scores import ChunkScores
from evictlayers.scoring.cross_layer import CrossLayer
from evictlayers.scoring.cumulative import Cumulative
from evictlayers.scoring.expected_attention import ExpectedAttention
from evictlayers.scoring.key_diff import KeyDiff
from evictlayers.scoring.key_norm import KeyNorm
from evictlayers.scoring.layer_scope import LayerScope
from evictlayers.scoring.low_score_counter import LowScoreCounter
from evictlayers.scoring.pooled_scores import PooledScores
from evictlayers.scoring.recent_then_cumulative import RecentThenCumulative
from evictlayers.scoring.reconstruction import ContextReconstruction
from evictlayers.scoring.refinement import ScoreRefinement
from evictlayers.scoring.sentence_scores import SentenceScores
from evictlayers.scoring.step_gain import ScoreTransform, StepGainSoftmax
from evictlayers.scoring.value_prior import ScorePrior, ValuePrior
from evictlayers.scoring.view import Observation, SlotView
from evictlayers.scoring.windowed import Windowed

__all__ = [
    "Averaged",
    "ChunkScores",
    "ContextReconstruction",
    "CrossLayer",
    "Cumulative",
    "ExpectedAttention",
    "KeyDiff",
    "KeyNorm",
    "LayerScope",
    "LowScoreCounter",
    "Observation",
    "PooledScores",
    "RecentThenCumulative",
    "ScoreAccumulator",
    "ScorePrior",
    "ScoreRefinement",
    "ScoreTransform",
    "SentenceScores",
    "SlotView",
    "StepGainSoftmax",
    "ValuePrior",
    "Windowed",
]

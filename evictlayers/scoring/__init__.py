"""How important a token is: accumulators over the attention mass each slot receives or over the
slots' keys, the softmax transform they score with, and per-slot priors."""

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.averaged import Averaged
from evictlayers.scoring.cross_layer import CrossLayer
from evictlayers.scoring.cumulative import Cumulative
from evictlayers.scoring.key_diff import KeyDiff
from evictlayers.scoring.key_norm import KeyNorm
from evictlayers.scoring.low_score_counter import LowScoreCounter
from evictlayers.scoring.recent_then_cumulative import RecentThenCumulative
from evictlayers.scoring.step_gain import ScoreTransform, StepGainSoftmax
from evictlayers.scoring.value_prior import ScorePrior, ValuePrior
from evictlayers.scoring.view import Observation, SlotView
from evictlayers.scoring.windowed import Windowed

__all__ = [
    "Averaged",
    "CrossLayer",
    "Cumulative",
    "KeyDiff",
    "KeyNorm",
    "LowScoreCounter",
    "Observation",
    "RecentThenCumulative",
    "ScoreAccumulator",
    "ScorePrior",
    "ScoreTransform",
    "SlotView",
    "StepGainSoftmax",
    "ValuePrior",
    "Windowed",
]

"""How important a token is: accumulators over the attention mass each slot receives."""

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.averaged import Averaged
from evictlayers.scoring.component import Component
from evictlayers.scoring.cumulative import Cumulative
from evictlayers.scoring.view import Observation, SlotView

__all__ = ["Averaged", "Component", "Cumulative", "Observation", "ScoreAccumulator", "SlotView"]

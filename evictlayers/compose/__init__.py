"""Policies, budgets, the per-layer slot store that runs them, and recipe YAML."""

from evictlayers.compose.allocation import Allocation, ByLayerKind, Induction, Pyramid, Ramp, Uniform
from evictlayers.compose.policy import Policy
from evictlayers.compose.recipes import RecipeError, dump_recipe, load_recipe
from evictlayers.compose.store import CompileError, PolicyError, SlotStore

__all__ = ["Allocation", "ByLayerKind", "Induction", "CompileError", "Policy", "PolicyError", "Pyramid", "Ramp", "Uniform", "RecipeError", "SlotStore", "dump_recipe", "load_recipe"]

"""RapidFireOptimizer: an inner torch optimizer with gradient pipeline, verification and exact rollback."""

from rapidfire_hf.optim.health import OptimizerEvent
from rapidfire_hf.optim.inner import INNER_OPTIMIZERS
from rapidfire_hf.optim.optimizer import RapidFireOptimizer
from rapidfire_hf.optim.snapshot import Snapshot

__all__ = ["INNER_OPTIMIZERS", "OptimizerEvent", "RapidFireOptimizer", "Snapshot"]

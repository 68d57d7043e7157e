"""rapidfire_hf inside existing trainers: ``enable_rapidfire`` and W&B / metrics logging.

Example:
    >>> from trl import SFTTrainer
    >>> from rapidfire_hf import enable_rapidfire
    >>> trainer = enable_rapidfire(SFTTrainer(...), config={"gradient_pipeline": True})  # doctest: +SKIP
"""

from rapidfire_hf.integrations.enable import RapidFireIntegrationError, enable_rapidfire
from rapidfire_hf.integrations.metrics import RapidFireMetricsCallback, peak_flops
from rapidfire_hf.integrations.wandb_logger import RapidFireWandbCallback, WandbLogger

__all__ = [
    "RapidFireIntegrationError",
    "RapidFireMetricsCallback",
    "RapidFireWandbCallback",
    "WandbLogger",
    "enable_rapidfire",
    "peak_flops",
]

"""DSpark block drafter: config, MLX network, DeepSpec-layout loader/saver, per-request drafter.

The trainer lives in :mod:`drafters.dspark.train` (imported on demand: it pulls in tqdm and
the data builders).
"""

from .config import DSparkConfig, build_target_layer_ids, draft_config_from_target
from .drafter import DraftStep, DSparkDrafter, prefix_survival
from .loader import load_dspark, save_dspark
from .model import DSparkModel, init_weights, reference_draft
from .target import TargetTaps
from .vocab import DraftVocab

__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DraftStep",
    "DraftVocab",
    "DSparkModel",
    "TargetTaps",
    "build_target_layer_ids",
    "draft_config_from_target",
    "init_weights",
    "load_dspark",
    "prefix_survival",
    "reference_draft",
    "save_dspark",
]

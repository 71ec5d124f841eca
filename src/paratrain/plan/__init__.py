"""The planner behind ``paratrain plan``: predicts per-rank memory and step time of every
layout of a model on a cluster, and ranks them. Pure arithmetic, no torch at import.

Modules: ``hardware`` (GPUs, clusters, links, the local calibration), ``models`` (model
shapes), ``memory`` (published formulas), ``runtime`` (paratrain's own runs, exactly),
``cost`` (compute, communication, bubble), ``search`` (enumerate and rank), ``report``
(tables, JSON), ``export`` (configs, plots), ``calibrate`` (measures this machine; the
only module that uses torch, lazily), ``cli`` (the sub-command).
"""

from .candidate import Candidate, Training
from .hardware import GPUS, Cluster, GpuSpec, gpu_preset, local_cluster
from .models import PRESETS, ModelSpec, load_model
from .results import SearchResult
from .search import search

__all__ = [
    "Candidate", "Training", "GPUS", "Cluster", "GpuSpec", "gpu_preset", "local_cluster",
    "PRESETS", "ModelSpec", "load_model", "SearchResult", "search",
]

"""Context parallelism: a sequence split over the ranks of a ``torch.distributed`` group, exact.

``context_parallel`` runs an operator on this rank's slice; ``summaries`` holds what the ranks
exchange (per-operator slice summaries and their combines, derived there); ``run_slices`` is the same
algorithm in one process.
"""
from .context_parallel import context_parallel, run_slices
from .summaries import SUMMARIES, decayed_linear_attention, summary_numbers

__all__ = ["context_parallel", "run_slices", "SUMMARIES", "summary_numbers", "decayed_linear_attention"]

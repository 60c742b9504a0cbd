"""Tensor parallelism that keeps the bits: strict ``ParallelStyle``s for
``torch.distributed.tensor.parallel.parallelize_module`` whose cross-rank combines are the
contracts' fixed trees (``segmented_gemm``), never a collective's own reduction order.

``parallelize_muse_glimmer(model, mesh)`` shards a patched Muse Glimmer (``apply_opcontract``)
the way transformers' ``base_model_tp_plan`` does; ``provenance(model)`` says how.
``context_parallel_muse_glimmer(model, mesh)`` splits its training sequences instead
(``opcontract.parallel.context``).
"""

from opcontract.parallel.context import context_parallel_muse_glimmer
from opcontract.parallel.muse_glimmer import parallelize_muse_glimmer, provenance, tp_plan
from opcontract.parallel.styles import (
    ParallelPlanError,
    StrictColwiseParallel,
    StrictRowwiseParallel,
    StrictVocabParallelEmbedding,
)

__all__ = [
    "ParallelPlanError",
    "StrictColwiseParallel",
    "StrictRowwiseParallel",
    "StrictVocabParallelEmbedding",
    "context_parallel_muse_glimmer",
    "parallelize_muse_glimmer",
    "provenance",
    "tp_plan",
]

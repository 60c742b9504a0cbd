"""Named results of the ops with several outputs, built from their contracts."""

from __future__ import annotations

from opcontract.contracts.results import result_type

LogprobOutput = result_type("softcap_logprob")
CrossEntropyOutput = result_type("linear_cross_entropy")
AddNormOutput = result_type("fused_add_rms_norm")
EmbeddingOutput = result_type("normalized_embedding")
QKOutput = result_type("qk_norm_rope")
SamplerHeadOutput = result_type("softcap_logits")
SliceStatsOutput = result_type("vocab_slice_stats")
SliceGradOutput = result_type("vocab_slice_grad")

__all__ = [
    "AddNormOutput",
    "CrossEntropyOutput",
    "EmbeddingOutput",
    "LogprobOutput",
    "QKOutput",
    "SamplerHeadOutput",
    "SliceGradOutput",
    "SliceStatsOutput",
]

"""linear_cross_entropy on the Triton softcap_logprob head, reduced like every backend."""

from __future__ import annotations

from opcontract.backends import linear_cross_entropy as lce
from opcontract.backends.triton import softcap_logprob as slp


# fmt: off
def forward(config, hidden, weight, targets, *, multiplier, softcap, ignore_index, reduction,
            label_smoothing, return_token_accuracy, temperature=1.0, logits_gemm=None):
    """(loss, token_accuracy, lse)."""
    r = slp.forward_all(hidden, weight, targets, multiplier=multiplier, softcap=softcap,
                        ignore_index=ignore_index, argmax=return_token_accuracy,
                        zsum=label_smoothing > 0, config=config, temperature=temperature,
                        logits_gemm=logits_gemm)
    loss, acc = lce.loss_and_accuracy(r.logprob, r.smooth, r.predicted, targets,
                                      ignore_index=ignore_index, reduction=reduction,
                                      label_smoothing=label_smoothing)
    return loss, acc, r.lse


def backward(config, saved, grads, needs, *, multiplier, softcap, ignore_index, reduction,
             label_smoothing, return_token_accuracy, temperature=1.0, grad_gemm="triton",
             logits_gemm=None):
    g_lp, g_sm = lce.head_grads(grads["loss"], saved["targets"], ignore_index=ignore_index,
                                reduction=reduction, label_smoothing=label_smoothing)
    return slp.head_backward(config, saved, g_lp, None, g_sm, needs, multiplier=multiplier,
                             softcap=softcap, ignore_index=ignore_index, temperature=temperature,
                             grad_gemm=grad_gemm, logits_gemm=logits_gemm)
# fmt: on

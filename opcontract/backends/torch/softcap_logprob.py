"""softcap_logprob in plain torch: the float64 oracle, the portable strict path, and stock eager.

The strict path uses only elementwise IEEE operations (one rounding per multiply and per
add), so the order of every reduction is written in this file and nowhere else:

* gemm_k: one float32 accumulator per logit; the K dimension is walked one element at a
  time in ascending order (block 1): ``acc = acc + h[:, k] * w[:, k]``.
* vocab_lse / vocab_entropy: the vocabulary is walked in blocks of ``VOCAB_BLOCK``; within
  a block, sums are a fixed pairwise tree (halving the width each step); block partials
  merge in ascending order with the online max rescale.
* vocab_argmax: per block (max, first index at the max); a later block wins only with a
  strictly larger max.
* vocab_sq: per block, the tree sum of exp(2 (z - m_b)), merged alongside vocab_lse with the
  squared rescale factors exp(2 (M - M')) and exp(2 (m_b - M')).
* grad_hidden_v: chunks of ``GRAD_CHUNK`` columns in ascending order, each chunk's
  partial summed over its columns one at a time, then added to a float32 buffer.
* grad_weight_t: one float32 accumulator per element, the tokens walked one at a time
  (per vocabulary block over all tokens, or, in the token_chunks plan, per chunk of tokens
  into a float32 [V, H] buffer: the same additions in the same order).

exp, log and tanh come from ``elementwise`` (float64, rounded once): torch's float32 CPU
versions depend on an element's position in the tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from opcontract.backends.fixed_order import tree_sum
from opcontract.backends.softcap_head import head_constants
from opcontract.backends.torch import elementwise as ew
from opcontract.contracts import get_contract

_C = get_contract("softcap_logprob")
VOCAB_BLOCK = _C.reductions["vocab_lse"].block
GRAD_CHUNK = _C.reductions["grad_hidden_v"].block


def _result(logprob, entropy, predicted, return_entropy, return_predicted, mean_logits=None,
            log_sum_sq_probs=None):  # fmt: skip
    if not (return_entropy or return_predicted or mean_logits is not None
            or log_sum_sq_probs is not None):  # fmt: skip
        return logprob
    from opcontract.outputs import LogprobOutput

    return LogprobOutput(
        logprob,
        entropy if return_entropy else None,
        predicted if return_predicted else None,
        mean_logits,
        log_sum_sq_probs,
    )


def logits64(hidden, weight, multiplier: float = 1.0, softcap: float | None = None,
             temperature: float = 1.0):  # fmt: skip
    """The float64 oracle's [T, V] logits z (divided by the temperature)."""
    y = (hidden.double() @ weight.double().T) * multiplier
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
    return z if temperature == 1.0 else z / temperature


def argmax_is_ambiguous(hidden, weight, *, multiplier=1.0, softcap=None, temperature=1.0,
                        **_) -> bool:  # fmt: skip
    """Whether some row's two largest float64 logits lie within float32 rounding of each other
    (the contract's argmax is over float32 z, lowest index among ties: the float64 oracle
    cannot arbitrate those rows)."""
    z = logits64(hidden, weight, multiplier, softcap, temperature)
    if z.shape[-1] < 2 or z.numel() == 0:
        return False
    top = z.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).abs()
    return bool((gap <= 1e-5 * top[..., 0].abs().clamp(min=1.0)).any() | ~torch.isfinite(top).all())


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_predicted: bool = False,
    temperature: float = 1.0,
    return_mean_logits: bool = False,
    return_log_sum_sq_probs: bool = False,
):
    """Float64 oracle of the contract's math (differentiable). Float64 [T] outputs."""
    z = logits64(hidden, weight, multiplier, softcap, temperature)
    t = targets.long()
    keep = t != ignore_index
    lse = torch.logsumexp(z, dim=1)
    zt = z.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    logprob = torch.where(keep, zt - lse, 0.0)
    entropy = lse - (torch.softmax(z, dim=1) * z).sum(1) if return_entropy else None
    predicted = z.argmax(dim=1) if return_predicted else None
    mean = z.mean(dim=1) if return_mean_logits else None
    # log sum_v p^2 = logsumexp_v 2 log p: no exp(2z) to overflow
    sq = torch.logsumexp(2.0 * (z - lse[:, None]), dim=1) if return_log_sum_sq_probs else None
    return _result(logprob, entropy, predicted, return_entropy, return_predicted, mean, sq)


def _block_logits(
    h32: torch.Tensor,
    weight: torch.Tensor,
    v0: int,
    multiplier: float,
    softcap: float | None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z, tanh value t (None without a cap) and validity of VOCAB_BLOCK columns from v0."""
    T, H = h32.shape
    V = weight.shape[0]
    nv = min(VOCAB_BLOCK, V - v0)
    w = torch.zeros(VOCAB_BLOCK, H, dtype=torch.float32, device=h32.device)
    w[:nv] = weight[v0 : v0 + nv].float()
    acc = torch.zeros(T, VOCAB_BLOCK, dtype=torch.float32, device=h32.device)
    for k in range(H):  # gemm_k: ascending, one rounding per multiply and per add
        acc = acc + h32[:, k : k + 1] * w[:, k]
    scale, outer, _ = head_constants(multiplier, softcap, temperature)
    if outer is None:
        z, t = acc * scale, None
    else:  # the contract's scale: multiplier / softcap formed in float64, rounded once
        scale = torch.tensor(scale, dtype=torch.float32, device=h32.device)
        t = ew.tanh(acc * scale)
        z = outer * t
    valid = torch.arange(VOCAB_BLOCK, device=h32.device) < nv
    return z, t, valid


class Walk(NamedTuple):
    """What one walk over ascending vocabulary blocks keeps per row (float32): the running
    max and sum exp(z - max) (vocab_lse), sum exp(z - max) z (vocab_entropy), the first
    maximum and its column (vocab_argmax), the plain sum of z (vocab_zsum; zeros unless
    asked for), the target's z (0 where no block holds the target) and sum exp(2 (z - max))
    (vocab_sq; None unless asked for)."""

    max: torch.Tensor
    sum: torch.Tensor
    zsum: torch.Tensor
    arg_max: torch.Tensor
    arg_idx: torch.Tensor
    z_total: torch.Tensor
    z_target: torch.Tensor
    sq: torch.Tensor | None = None


def block_walk(h, weight, t, multiplier, softcap, z_out=None, total=False,
               temperature=1.0, sq=False) -> Walk:  # fmt: skip
    """One pass over ``weight``'s rows in VOCAB_BLOCK blocks, ascending (the bits depend on
    it), for float32 rows ``h`` and int64 targets ``t`` (a value outside [0, V) selects no
    column). ``z_out`` ([T, V] float32) receives each block's z; ``total`` also sums z;
    ``sq`` also sums exp(2 (z - max))."""
    T, V = h.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    run_max = torch.full((T,), float("-inf"), **f32)
    run_sum = torch.zeros(T, **f32)
    run_zsum = torch.zeros(T, **f32)
    arg_max = torch.full((T,), float("-inf"), **f32)
    arg_idx = torch.zeros(T, dtype=torch.int64, device=h.device)
    z_total = torch.zeros(T, **f32)
    z_target = torch.zeros(T, **f32)
    run_sq = torch.zeros(T, **f32) if sq else None
    for v0 in range(0, V, VOCAB_BLOCK):
        z, _, valid = _block_logits(h, weight, v0, multiplier, softcap, temperature)
        if z_out is not None:
            z_out[:, v0 : v0 + VOCAB_BLOCK] = z[:, : min(VOCAB_BLOCK, V - v0)]
        z = torch.where(valid, z, float("-inf"))
        m_b = z.max(dim=1).values
        e = ew.exp(z - m_b[:, None])
        s_b = tree_sum(e)
        w_b = tree_sum(torch.where(valid, e * z, 0.0))
        new_max = torch.maximum(run_max, m_b)
        old_scale, b_scale = ew.exp(run_max - new_max), ew.exp(m_b - new_max)
        run_sum = run_sum * old_scale + s_b * b_scale
        run_zsum = run_zsum * old_scale + w_b * b_scale
        if sq:  # vocab_sq: the block's exp(2 (z - m_b)), rescaled by the squared factors
            s2_b = tree_sum(ew.exp(2.0 * (z - m_b[:, None])))
            run_sq = (run_sq * ew.exp(2.0 * (run_max - new_max))
                      + s2_b * ew.exp(2.0 * (m_b - new_max)))  # fmt: skip
        run_max = new_max
        first = (z == m_b[:, None]).int().argmax(dim=1) + v0
        arg_idx = torch.where(m_b > arg_max, first, arg_idx)
        arg_max = torch.maximum(arg_max, m_b)
        if total:
            z_total = z_total + tree_sum(torch.where(valid, z, 0.0))  # vocab_zsum
        hit = (t >= v0) & (t < v0 + VOCAB_BLOCK)
        zt = z.gather(1, torch.where(hit, t - v0, 0)[:, None])[:, 0]
        z_target = torch.where(hit, zt, z_target)
    return Walk(run_max, run_sum, run_zsum, arg_max, arg_idx, z_total, z_target, run_sq)


def strict_forward_all(hidden, weight, targets, multiplier, softcap, ignore_index, z_out=None,
                       temperature=1.0, sq=False):  # fmt: skip
    """(logprob, entropy, predicted, lse, mean_z, smooth, mean_logits, log_sum_sq_probs):
    every output and what backward needs; mean_logits = sum_v z / V (vocab_zsum), smooth =
    lse - mean_logits, label smoothing's term, and with ``sq`` log_sum_sq_probs = log(S2) -
    2 log(S) (vocab_sq; None without). ``z_out`` ([T, V] float32, the sampler head's):
    receives every block's z as it is computed."""
    V = weight.shape[0]
    t = targets.long()
    w = block_walk(hidden.float(), weight, t, multiplier, softcap, z_out, total=True,
                   temperature=temperature, sq=sq)  # fmt: skip
    log_sum = ew.log(w.sum)
    lse = w.max + log_sum
    mean_z = w.zsum / w.sum
    logprob = torch.where(t != ignore_index, w.z_target - lse, 0.0)
    mean_logits = w.z_total / V
    log_sum_sq = ew.log(w.sq) - 2.0 * log_sum if sq else None
    return (logprob, lse - mean_z, w.arg_idx, lse, mean_z, lse - mean_logits, mean_logits,
            log_sum_sq)  # fmt: skip


PLANS = ("vocab_chunks", "token_chunks")  # the contract's equal-bits backward plans
DEFAULT_PLAN = {"backward_plan": "vocab_chunks", "token_chunk": 1024}
CONFIG_SPACE = {"backward_plan": PLANS, "token_chunk": (256, 512, 1024, 2048)}


def plan_memory(T: int, H: int, V: int, dtype: str, config: dict) -> dict[str, int]:
    """Bytes of the float32 buffers each backward plan holds beyond its inputs and the
    gradients it returns (the per-block temporaries of VOCAB_BLOCK columns not counted):
    vocab_chunks grad_hidden and a chunk's partial, [T, H] each; token_chunks the same for
    C = min(token_chunk, T) rows, and the [V, H] grad_weight buffer."""
    c = min(int(config.get("token_chunk", DEFAULT_PLAN["token_chunk"])), T)
    return {"vocab_chunks": 2 * T * H * 4, "token_chunks": 2 * c * H * 4 + V * H * 4}


def _block_grad(h, weight, t, lse, mean_z, gl, ge, gs, v0, dtype, multiplier, softcap,
                temperature=1.0):  # fmt: skip
    """g (float32 holding input-dtype values) of VOCAB_BLOCK columns from v0 for h's rows,
    and how many of them are real; elementwise, so a row's g is the same in any set of rows."""
    V = weight.shape[0]
    z, tanh_z, valid = _block_logits(h, weight, v0, multiplier, softcap, temperature)
    p = ew.exp(z - lse[:, None])
    cols = torch.arange(v0, v0 + VOCAB_BLOCK, device=h.device)
    gz = gl[:, None] * ((cols[None, :] == t[:, None]).float() - p)
    if ge is not None:
        gz = gz - ge[:, None] * p * (z - mean_z[:, None])
    if gs is not None:  # d(lse - mean_v z)/dz = p - 1/V
        gz = gz + gs[:, None] * (p - 1.0 / V)
    _, outer, dz = head_constants(multiplier, softcap, temperature)
    if outer is not None:
        dz = dz * (1.0 - tanh_z * tanh_z)
    g = torch.where(valid, gz * dz, 0.0).to(dtype).float()  # declared cast
    return g, int(valid.sum())


def _add_tokens(acc, g, h, nv):
    """grad_weight_t: acc + g[i, :nv] h[i] for the rows i in ascending order."""
    for i in range(h.shape[0]):
        acc = acc + g[i, :nv, None] * h[i]
    return acc


def _rows_backward(
    h,
    weight,
    t,
    lse,
    mean_z,
    gl,
    ge,
    gs,
    dtype,
    multiplier,
    softcap,
    temperature=1.0,
    *,
    grad_w,
    buffer,
    need_hidden,
):
    """grad_hidden of h's rows in float32 (None unless ``need_hidden``; grad_hidden_v: chunks
    of GRAD_CHUNK columns in ascending order, columns one at a time within a chunk); each
    block's token products summed into ``grad_w`` where given: added to a float32 [V, H]
    buffer that continues across calls (``buffer``), or summed from zero and written once in
    grad_w's dtype."""
    V = weight.shape[0]
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_hidden else None
    for c0 in range(0, V, GRAD_CHUNK):  # grad_hidden_v: ascending chunks
        chunk_h = torch.zeros_like(grad_h) if need_hidden else None
        for v0 in range(c0, min(c0 + GRAD_CHUNK, V), VOCAB_BLOCK):
            g, nv = _block_grad(h, weight, t, lse, mean_z, gl, ge, gs, v0, dtype, multiplier,
                                softcap, temperature)  # fmt: skip
            if grad_w is not None:
                start = grad_w[v0 : v0 + nv] if buffer else torch.zeros_like(grad_w[:nv]).float()
                grad_w[v0 : v0 + nv] = _add_tokens(start, g, h, nv).to(grad_w.dtype)
            if need_hidden:
                w = weight[v0 : v0 + nv].float()
                for j in range(nv):  # within the chunk: columns in ascending order
                    chunk_h = chunk_h + g[:, j : j + 1] * w[j]
        if need_hidden:
            grad_h = grad_h + chunk_h
    return grad_h


def strict_backward(
    hidden,
    weight,
    targets,
    lse,
    mean_z,
    grad_logprob,
    grad_entropy,
    grad_smooth,
    multiplier,
    softcap,
    ignore_index,
    need_hidden=True,
    need_weight=True,
    plan="vocab_chunks",
    token_chunk=1024,
    temperature=1.0,
):
    """grad_hidden and grad_weight in the contract's order (see the module docstring), by
    one of the equal-bits plans. vocab_chunks: per vocabulary block, grad_weight's rows
    summed over every token and written once in the weight's dtype. token_chunks: per chunk
    of token_chunk rows, each block's token products added to a float32 [V, H] buffer
    (the same additions in the same order: grad_weight_t's block is one token), rounded
    once at the end; grad_hidden the same per row either way."""
    if plan not in PLANS:
        raise ValueError(f"unknown backward plan {plan!r}; one of {PLANS}")
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    h = hidden.float()
    t = targets.long()
    gl = torch.where(t != ignore_index, grad_logprob.float(), 0.0)
    ge = grad_entropy.float() if grad_entropy is not None else None
    gs = grad_smooth.float() if grad_smooth is not None else None
    mz = mean_z if ge is not None else None
    head = (hidden.dtype, multiplier, softcap, temperature)
    if plan == "vocab_chunks" or T == 0:
        grad_w = torch.zeros(V, H, dtype=weight.dtype, device=dev) if need_weight else None
        grad_h = _rows_backward(h, weight, t, lse, mz, gl, ge, gs, *head, grad_w=grad_w,
                                buffer=False, need_hidden=need_hidden)  # fmt: skip
        return (grad_h.to(hidden.dtype) if need_hidden else None), grad_w
    buf = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_weight else None
    rows = []
    for t0 in range(0, T, token_chunk):  # ascending token chunks
        r = slice(t0, min(t0 + token_chunk, T))

        def part(x, r=r):
            return x[r] if x is not None else None

        rows.append(
            _rows_backward(h[r], weight, t[r], lse[r], part(mz), gl[r], part(ge), part(gs),
                           *head, grad_w=buf, buffer=True, need_hidden=need_hidden)
        )  # fmt: skip
    return (
        torch.cat(rows).to(hidden.dtype) if need_hidden else None,
        buf.to(weight.dtype) if need_weight else None,
    )


def forward(
    config,
    hidden,
    weight,
    targets,
    *,
    multiplier,
    softcap,
    ignore_index,
    return_entropy,
    return_predicted,
    temperature=1.0,
    return_mean_logits=False,
    return_log_sum_sq_probs=False,
):
    """(logprob, entropy, predicted, mean_logits, log_sum_sq_probs, lse, mean_z) in the
    contract's order; None where not asked for."""
    lp, ent, pred, lse, mean_z, _, mean_logits, log_sum_sq = strict_forward_all(
        hidden, weight, targets, multiplier, softcap, ignore_index, temperature=temperature,
        sq=return_log_sum_sq_probs,
    )  # fmt: skip
    return (
        lp,
        ent if return_entropy else None,
        pred if return_predicted else None,
        mean_logits if return_mean_logits else None,
        log_sum_sq,
        lse,
        mean_z if return_entropy else None,
    )


def backward(
    config,
    saved,
    grads,
    needs,
    *,
    multiplier,
    softcap,
    ignore_index,
    return_entropy,
    return_predicted,
    temperature=1.0,
    return_mean_logits=False,
    return_log_sum_sq_probs=False,
):
    """{hidden, weight}: the contract's backward, in the contract's order (mean_logits and
    log_sum_sq_probs carry no gradient)."""
    g_lp, g_ent = grads["logprob"], grads["entropy"] if return_entropy else None
    lse = saved["lse"]
    gh, gw = strict_backward(
        saved["hidden"], saved["weight"], saved["targets"], lse,
        saved["mean_z"] if g_ent is not None else None,
        g_lp if g_lp is not None else torch.zeros_like(lse), g_ent, None,
        multiplier, softcap, ignore_index,
        need_hidden=needs["hidden"], need_weight=needs["weight"],
        plan=config.get("backward_plan", "vocab_chunks"),
        token_chunk=config.get("token_chunk", DEFAULT_PLAN["token_chunk"]),
        temperature=temperature,
    )  # fmt: skip
    return {"hidden": gh, "weight": gw}


def eager_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_predicted: bool = False,
    temperature: float = 1.0,
    return_mean_logits: bool = False,
    return_log_sum_sq_probs: bool = False,
):
    """Stock eager: library GEMM, logits rounded to the input dtype, full [T, V] in memory."""
    y = (hidden @ weight.T).float() * multiplier
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
    z = z if temperature == 1.0 else z / temperature
    t = targets.long()
    keep = t != ignore_index
    logp_all = torch.log_softmax(z, dim=-1)
    logp = torch.where(keep, logp_all.gather(1, torch.where(keep, t, 0)[:, None])[:, 0], 0.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if return_entropy else None
    predicted = z.argmax(-1) if return_predicted else None
    mean = z.mean(-1) if return_mean_logits else None
    sq = torch.logsumexp(2.0 * logp_all, dim=-1) if return_log_sum_sq_probs else None
    return logp, entropy, predicted, mean, sq, torch.logsumexp(z, dim=-1), None

"""softcap_logprob's log_sum_sq_probs (return_log_sum_sq_probs: TRL's WPO weights): log sum_v
p^2 per row through vocab_sq's blocks, against float64, batch-invariant, without a gradient,
and a flag whose default moves no bit of any other output (nor the numerics hash).

torch.strict and triton.fused (the interpreter on the CPU) are each held to the float64
oracle and to their own bits; they are not bitwise equal to each other, as none of the
head's float outputs is (gemm_k's block and the in-block sums are each implementation's)."""

import math

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.backends.torch.softcap_logprob import reference
from opcontract.contracts import get_contract
from opcontract.contracts.loader import parse_contract

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: interpreter on the CPU
BACKENDS = ["torch", "triton"]
C = get_contract("softcap_logprob")
TOL = C.tolerance  # relative error ||out - ref|| / ||ref||, per dtype
# (T, H, V, params, weight std): a cap at Muse Glimmer's multiplier over 5 blocks with a short
# last one; no cap at temperature 0.7 with peaked rows (log sum p^2 near 0); one short block
CASES = [
    (9, 64, 600, dict(multiplier=0.19611613513818404, softcap=20.0), 2.0),
    (7, 48, 300, dict(multiplier=1.0, softcap=None, temperature=0.7), 0.6),
    (5, 32, 100, dict(multiplier=0.5, softcap=30.0), 1.0),
]
ALL = dict(return_entropy=True, return_predicted=True, return_mean_logits=True)


def _inputs(T, H, V, std, dtype, seed=0):
    h, w, t = head_inputs(T=T, H=H, V=V, dtype=torch.float32, seed=seed, ignore=(1,))
    return h.to(dtype).to(DEVICE), (w * (std / 0.5)).to(dtype).to(DEVICE), t.to(DEVICE)


def _call(backend, h, w, t, **kw):
    return dispatch.op("softcap_logprob", backend=backend)(h, w, t, **kw)


def _oracle(h, w, t, params):
    """log sum_v p^2 in float64 from float64 logits of the same (rounded) inputs."""
    return reference(h.double().cpu(), w.double().cpu(), t.cpu(), **params,
                     return_log_sum_sq_probs=True).log_sum_sq_probs  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_against_float64(backend, dtype, case):
    """Within the contract's tolerance of float64 (relative norm), every element within
    1e-5 absolute; a peaked case reaches log sum p^2 > -0.5 (its running rescale matters)."""
    T, H, V, params, std = CASES[case]
    h, w, t = _inputs(T, H, V, std, dtype)
    out = _call(backend, h, w, t, **params, return_log_sum_sq_probs=True)
    got, ref = out.log_sum_sq_probs.cpu(), _oracle(h, w, t, params)
    assert got.dtype == torch.float32 and got.shape == (T,)
    rel = float((got.double() - ref).norm() / ref.norm())
    assert rel <= TOL[str(dtype).removeprefix("torch.")], rel
    assert float((got.double() - ref).abs().max()) <= 1e-5
    assert bool((ref <= 0).all()) and bool((ref >= -math.log(V) - 1e-9).all())
    if case == 1:
        assert float(ref.max()) > -0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_rows_give_minus_log_v(backend):
    """z = 0 everywhere (zero hidden rows): p = 1/V, log sum p^2 = -log V, the float32 value."""
    V = 300
    h = torch.zeros(3, 16, device=DEVICE)
    w = torch.randn(V, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    t = torch.tensor([0, 5, -100], device=DEVICE)
    got = _call(backend, h, w, t, return_log_sum_sq_probs=True).log_sum_sq_probs.cpu()
    want = torch.full((3,), -math.log(V), dtype=torch.float64)
    assert float((got.double() - want).abs().max()) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strict_and_triton_agree_within_the_tolerance(dtype):
    """Not bitwise (see the module docstring): within the contract's tolerance of each other."""
    T, H, V, params, std = CASES[0]
    h, w, t = _inputs(T, H, V, std, dtype, seed=3)
    a, b = (_call(be, h, w, t, **params, return_log_sum_sq_probs=True).log_sum_sq_probs.cpu()
            for be in BACKENDS)  # fmt: skip
    assert float((a.double() - b.double()).norm() / a.double().norm()) <= TOL["float32"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_alone_has_the_bits_it_has_in_a_batch(backend, dtype):
    """torch.equal of each row's log_sum_sq_probs alone, in a batch of 40 (more than one row
    tile) and in a batch of 3 rows."""
    T, H, V, params, std = CASES[0]
    h, w, t = _inputs(40, H, V, std, dtype, seed=5)
    kw = dict(params, return_log_sum_sq_probs=True)
    full = _call(backend, h, w, t, **kw).log_sum_sq_probs
    for rows in ([0], [17], [39], [2, 33, 21]):
        part = _call(backend, h[rows], w, t[rows], **kw).log_sum_sq_probs
        assert torch.equal(part, full[rows]), rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_flows_from_it(backend):
    """log_sum_sq_probs adds nothing to the gradients: those of logprob + entropy + it equal
    those of logprob + entropy, bitwise; its own gradient is zero."""
    T, H, V, params, std = CASES[2]
    h, w, t = _inputs(T, H, V, std, torch.float32)
    grads = []
    for with_sq in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = _call(backend, hh, ww, t, **params, return_entropy=True,
                    return_log_sum_sq_probs=with_sq)  # fmt: skip
        loss = out.logprob.sum() + 0.5 * out.entropy.sum()
        if with_sq:
            only = torch.autograd.grad(out.log_sum_sq_probs.sum(), [hh, ww], retain_graph=True,
                                       allow_unused=True)  # fmt: skip
            assert all(g is None or not bool(g.any()) for g in only)
            loss = loss + 3.0 * out.log_sum_sq_probs.sum()
        grads.append(torch.autograd.grad(loss, [hh, ww]))
    assert grads[0][0].abs().sum() > 0
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert not C.outputs["log_sum_sq_probs"].differentiable


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_flag_moves_no_other_bit(backend, dtype):
    """Every other output (and lse's use: logprob), with the flag at its default and on,
    torch.equal; at its default the field is None, alone the result is still a tensor."""
    T, H, V, params, std = CASES[1]
    h, w, t = _inputs(T, H, V, std, dtype, seed=2)
    off = _call(backend, h, w, t, **params, **ALL)
    on = _call(backend, h, w, t, **params, **ALL, return_log_sum_sq_probs=True)
    assert off.log_sum_sq_probs is None and on.log_sum_sq_probs is not None
    for name in ("logprob", "entropy", "predicted", "mean_logits"):
        assert torch.equal(getattr(off, name), getattr(on, name)), name
    plain = _call(backend, h, w, t, **params)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, on.logprob)
    alone = _call(backend, h, w, t, **params, return_log_sum_sq_probs=True)
    assert alone.entropy is None and torch.equal(alone.logprob, plain)
    assert torch.equal(alone.log_sum_sq_probs, on.log_sum_sq_probs)


def test_the_contract_declares_it_without_moving_the_numerics_hash():
    """A neutral flag (default false): its param, output and vocab_sq reduction are left out of
    the numerics hash, so every shipped tuning entry keeps its hash; vocab_sq shares
    vocab_lse's blocks and merge."""
    text = open(C.path).read()
    sq, lse = C.reductions["vocab_sq"], C.reductions["vocab_lse"]
    assert sq.when == "return_log_sum_sq_probs" and C.outputs["log_sum_sq_probs"].when == sq.when
    assert (sq.block, sq.order, sq.merge, sq.split) == (lse.block, lse.order, lse.merge, lse.split)
    assert C.params["return_log_sum_sq_probs"].default is False
    param = text[text.index("  return_log_sum_sq_probs:\n") : text.index("outputs:\n")]
    output = text[text.index("  log_sum_sq_probs:\n") : text.index("residuals:\n")]
    red = text[text.index("  vocab_sq:\n") : text.index("  grad_hidden_v:\n")]
    without = text.replace(param, "").replace(output, "").replace(red, "")
    without = without.replace(",\n               return_log_sum_sq_probs: true}", "}")
    assert "log_sum_sq" not in without
    assert parse_contract(without).numerics_sha256 == C.numerics_sha256
    moved = parse_contract(text.replace("    when: return_log_sum_sq_probs\n    doc: >-\n      The",
                                        "    doc: >-\n      The", 1))  # fmt: skip
    assert moved.numerics_sha256 != C.numerics_sha256  # an always-on vocab_sq would count


def test_linear_cross_entropy_refuses_the_flag_by_name():
    h, w, t = head_inputs(T=4, H=16, V=200)
    with pytest.raises(ContractViolation, match="return_log_sum_sq_probs"):
        dispatch.op("linear_cross_entropy", backend="torch")(h, w, t, return_log_sum_sq_probs=True)


def test_the_vocabulary_parallel_head_refuses_it_by_name():
    """logprob_head on a model whose head is vocabulary-parallel (opcontract.parallel) refuses
    log_sum_sq_probs before any work: its vocab_slice contracts declare no such output."""
    from opcontract.integrations.tiny import tiny_muse_glimmer
    from opcontract.integrations.transformers import SHARDED_HEAD, logprob_head

    model = tiny_muse_glimmer()
    setattr(model, SHARDED_HEAD, object())  # never reached
    h = torch.randn(3, model.config.text_config.hidden_size)
    with pytest.raises(ValueError, match="log_sum_sq_probs: the vocabulary-parallel head"):
        logprob_head(model, h, torch.tensor([1, 2, 3]), log_sum_sq_probs=True)

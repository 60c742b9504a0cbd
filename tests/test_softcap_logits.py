"""The sampler's head (softcap_logits): logits[t, y] - lse[t] is bitwise softcap_logprob's
log-probability of y, for the rows alone and inside a trainer's batch; T above 256 is refused."""

import pytest
import torch
import triton
import triton.language as tl
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.backends.triton.softcap_logprob_kernels import (
    _merge_one,
    _merge_start,
    _merge_store,
)
from opcontract.outputs import SamplerHeadOutput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: interpreter on the CPU


def _inputs(T, dtype, V=300, H=40, seed=0):
    return [x.to(DEVICE) for x in head_inputs(T=T, H=H, V=V, dtype=dtype, seed=seed, ignore=())]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params", [{"multiplier": 0.19611613513818404, "softcap": 20.0}, {"multiplier": 0.7}]
)
def test_sampled_logprob_is_the_trainers_bitwise(backend, dtype, params):
    h, w, t = _inputs(70, dtype)
    train = dispatch.op("softcap_logprob", backend=backend)(h, w, t, **params)  # the trainer
    head = dispatch.op("softcap_logits", backend=backend)
    for rows in (slice(0, 1), slice(3, 12), slice(0, 70)):  # decode batches of 1, 9 and 70
        out = head(h[rows], w, **params)
        assert isinstance(out, SamplerHeadOutput)
        assert out.logits.shape == (h[rows].shape[0], w.shape[0]) and out.lse.dtype == torch.float32
        stored = out.logits.gather(1, t[rows, None])[:, 0] - out.lse  # what a rollout keeps
        assert torch.equal(stored, train[rows])
        # every token's log-prob, not only the target's: the logits are softcap_logprob's z
        y = torch.roll(t[rows], 1)
        lp = dispatch.op("softcap_logprob", backend=backend)(h[rows], w, y, **params)
        assert torch.equal(out.logits.gather(1, y[:, None])[:, 0] - out.lse, lp)


def test_full_decode_range_and_leading_dims():
    h, w, t = _inputs(256, torch.float32, V=130, H=16)
    out = dispatch.op("softcap_logits")(h, w, softcap=20.0)
    lp = dispatch.op("softcap_logprob")(h, w, t, softcap=20.0)
    assert torch.equal(out.logits.gather(1, t[:, None])[:, 0] - out.lse, lp)
    lead = dispatch.op("softcap_logits")(h.reshape(2, 128, 16), w, softcap=20.0)
    assert torch.equal(lead.logits.reshape(256, 130), out.logits)
    assert torch.equal(lead.lse.reshape(256), out.lse)


@pytest.mark.parametrize("shape", [(257, 16), (2, 129, 16)])
def test_more_than_256_rows_is_a_contract_violation(shape):
    h = torch.randn(*shape)
    w = torch.randn(30, 16)
    with pytest.raises(ContractViolation, match=r"'hidden'.*constraints.*at most 256 rows"):
        dispatch.op("softcap_logits")(h, w)
    with pytest.raises(ContractViolation, match=r"'hidden'.*at most 256 rows"):
        dispatch.explain("softcap_logits", h, w)


def test_explain_names_the_head_and_has_no_backward_plan():
    h, w, _ = _inputs(4, torch.bfloat16)
    r = dispatch.explain("softcap_logits", h, w, softcap=20.0, backend="triton")
    assert r.implementation == "triton.logits" and r.plan is None
    assert "backward plan" not in str(r)


@pytest.mark.parametrize("T", [1, 9, 16, 40, 64])
def test_the_apart_schedule_gives_the_fused_kernels_bits(T, monkeypatch):
    """schedule "apart": the logits' GEMM on the dense GEMM's decode tiles (16 or 64 rows),
    the partials kernel reading the float32 acc back. The sampler's logits and lse and every
    softcap_logprob output equal the fused kernel's, bitwise (a ragged last block: V = 300)."""
    from opcontract.backends.triton import softcap_logprob as slp

    calls = []
    decode = slp._logits_decode
    monkeypatch.setattr(slp, "_logits_decode", lambda *a: calls.append(1) or decode(*a))
    h, w, t = _inputs(T, torch.bfloat16)
    kw = {"multiplier": 0.19611613513818404, "softcap": 20.0}
    fused = dispatch.op("softcap_logits", backend="triton", config={"schedule": "tiles"})
    apart = dispatch.op("softcap_logits", backend="triton", config={"schedule": "apart"})
    want, got = fused(h, w, **kw), apart(h, w, **kw)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.lse, want.lse)
    outs = {"return_entropy": True, "return_predicted": True, "return_mean_logits": True}
    lp = [dispatch.op("softcap_logprob", backend="triton", config={"schedule": s})(
        h, w, t, **kw, **outs) for s in ("tiles", "apart")]  # fmt: skip
    for name in lp[0]._fields:
        a, b = getattr(lp[0], name), getattr(lp[1], name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert len(calls) == 2  # one GEMM a call: V = 300 fits one acc chunk


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64])
def test_the_apart_schedule_gives_the_fused_bits_at_muse_glimmers_head(T):
    """Muse Glimmer's head (H 6656, V 202048, bf16): the sampler's logits and lse by the
    schedule "apart" (the dense GEMM's decode tiles) equal the TMA kernel's, bitwise."""
    g = torch.Generator(device="cuda").manual_seed(T)
    w = (torch.randn(202048, 6656, device="cuda", generator=g) * 6656**-0.5).bfloat16()
    h = torch.randn(T, 6656, device="cuda", generator=g).bfloat16()
    kw = {"multiplier": 26**-0.5, "softcap": 20.0}
    want, got = (dispatch.op("softcap_logits", backend="triton", config={"schedule": s})(
        h, w, **kw) for s in ("tma", "apart"))  # fmt: skip
    assert torch.equal(got.logits, want.logits) and torch.equal(got.lse, want.lse)


@triton.jit
def _merge_one_block_at_a_time(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr,
                               t_ptr, logprob_ptr, lse_ptr, entropy_ptr, meanz_ptr, pred_ptr,
                               smooth_ptr, zmean_ptr, sq_ptr, T, V, NUM_BLOCKS, ignore_index,
                               BLOCK_R: tl.constexpr):
    """The reference merge: each block read as it is merged, every output on."""
    rows, row_ok, run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_start(T, BLOCK_R)
    for b in range(0, NUM_BLOCKS):
        part = b * T + rows.to(tl.int64)
        run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_one(
            run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq,
            tl.load(pmax_ptr + part, mask=row_ok), tl.load(psum_ptr + part, mask=row_ok),
            tl.load(pzs_ptr + part, mask=row_ok), tl.load(parg_ptr + part, mask=row_ok),
            tl.load(pzsum_ptr + part, mask=row_ok), tl.load(psq_ptr + part, mask=row_ok),
            True, True, True, True)
    _merge_store(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, zt_ptr, t_ptr,
                 logprob_ptr, lse_ptr, entropy_ptr, meanz_ptr, pred_ptr, smooth_ptr, zmean_ptr,
                 sq_ptr, rows, row_ok, V, ignore_index, True, True, True, True)


@pytest.mark.parametrize("T,blocks", [(1, 1), (3, 7), (5, 8), (130, 9)])
def test_the_prefetching_merge_gives_the_one_block_merges_bits(T, blocks):
    """``_merge_kernel`` (four blocks a tile, eight ahead of the chain) against a loop that
    reads each block as it merges it: every output bitwise, across a ragged last tile, a
    block whose max is -inf and zsums of -0.0 (on the GPU, compiled: the same fmas)."""
    from opcontract.backends.triton import softcap_logprob_kernels as k
    from opcontract.backends.triton.launch import launch

    gen = torch.Generator().manual_seed(T)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    pmax = (torch.randn(blocks, T, generator=gen) * 3).to(DEVICE)
    pmax[1:, 0] = float("-inf")
    psum = (torch.rand(blocks, T, generator=gen) * 100 + 1).to(DEVICE)
    pzs = (torch.randn(blocks, T, generator=gen) * 50).to(DEVICE)
    parg = torch.randint(0, 900, (blocks, T), generator=gen, dtype=torch.int32).to(DEVICE)
    pzsum = (torch.randn(blocks, T, generator=gen) * 10).to(DEVICE)
    pzsum[:, 0] = -0.0
    psq = (torch.rand(blocks, T, generator=gen) * 10 + 1).to(DEVICE)
    zt = torch.randn(T, generator=gen).to(DEVICE)
    tgt = torch.randint(0, 900, (T,), generator=gen).to(DEVICE)
    runs = []
    flags = {"ENTROPY": True, "ARGMAX": True, "ZSUM": True, "SQ": True}
    for kernel, kw in ((k._merge_kernel, flags), (_merge_one_block_at_a_time, {})):
        outs = [torch.empty(T, **f32) for _ in range(8)]
        outs[4] = torch.empty(T, dtype=torch.int64, device=DEVICE)
        launch(kernel, (-(-T // 128),), pmax, psum, pzs, parg, pzsum, psq, zt, tgt, *outs, T,
               900, blocks, -100, BLOCK_R=128, **kw)  # fmt: skip
        runs.append(outs)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)

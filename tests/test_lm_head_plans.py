"""The LM head's backward plans: vocab_chunks and token_chunks give the same bits (torch.equal on
every output and gradient), the caller or a memory budget picks one, explain and provenance
say which and what it costs, and the tuner's bitwise check covers the choice."""

import dataclasses

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.backends import registry
from opcontract.backends.registry import CallInfo, DeviceInfo, implementation
from opcontract.contracts import get_contract
from opcontract.tuning.sweep import SweepOp, _budget_check, study_space
from opcontract.tuning.verify import verify_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: interpreter on the CPU
PLANS = ("vocab_chunks", "token_chunks")

# (T, H, V, token_chunk): T not a multiple of the chunk (a short last chunk), one chunk only,
# and a vocabulary across grad_hidden_v's 4096-column chunks (bf16 only: the interpreter is slow)
SHAPES = [(300, 16, 300, 256), (5, 16, 300, 256), (20, 8, 4200, 256)]


def _grads(op, backend, plan, chunk, h, w, t, **params):
    """Every output of the call and the gradients of hidden and weight, by ``plan``."""
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    f = dispatch.op(op, backend=backend, plan=plan, config={"token_chunk": chunk})
    out = f(h, w, t, **params)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(1)
    diff = [o for o in outs if o is not None and o.dtype == torch.float32]
    ups = [torch.randn(o.shape, generator=gen).to(o.device) for o in diff]
    gh, gw = torch.autograd.grad(diff, [h, w], ups)
    assert dispatch.last_provenance().backward_plan == plan
    return [o for o in outs if o is not None] + [gh, gw]


def _assert_same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), f"max diff {(x.double() - y.double()).abs().max()}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,V,chunk", SHAPES)
def test_token_chunks_gives_the_bits_of_vocab_chunks(backend, dtype, T, H, V, chunk):
    if V > 1000 and dtype == torch.float32:
        pytest.skip("the float32 plans are compared at the smaller vocabularies")
    h, w, t = (x.to(DEVICE) for x in head_inputs(T=T, H=H, V=V, dtype=dtype, ignore=(1, 3)))
    slp = dict(multiplier=0.3, softcap=20.0, return_entropy=True)  # the entropy's gradient too
    runs = [_grads("softcap_logprob", backend, p, chunk, h, w, t, **slp) for p in PLANS]
    _assert_same_bits(*runs)
    assert runs[0][-1].abs().sum() > 0 and runs[0][-2].abs().sum() > 0  # real gradients
    if T < 100:  # linear_cross_entropy's head gradient (label smoothing's term) at one shape
        lce = dict(softcap=30.0, reduction="sum", label_smoothing=0.1)
        runs = [_grads("linear_cross_entropy", backend, p, chunk, h, w, t, **lce) for p in PLANS]
        _assert_same_bits(*runs)


def test_triton_token_chunks_of_several_partials():
    """Chunks of 512 tokens: two 256-token partials per chunk continue the buffer's sum."""
    h, w, t = (x.to(DEVICE) for x in head_inputs(T=520, H=8, V=130, dtype=torch.bfloat16))
    runs = [
        _grads("linear_cross_entropy", "triton", p, c, h, w, t, softcap=20.0)
        for p, c in (("vocab_chunks", 1024), ("token_chunks", 512))
    ]
    _assert_same_bits(*runs)


def test_plan_is_a_free_parameter_the_tuner_verifies(monkeypatch):
    c = get_contract("softcap_logprob")
    sizes = {"T": 7, "H": 16, "V": 200}
    for name in ("torch.strict", "triton.fused"):
        impl = implementation(name)
        assert set(impl.config_space["backward_plan"]) == set(c.plans)
        for chunk in (256, 512):
            cfg = {"backward_plan": "token_chunks", "token_chunk": chunk}
            assert verify_config(impl, c, "bfloat16", sizes, cfg).ok
    # negative control: a token plan that moves the gradient's bits is caught and named
    impl = implementation("torch.strict")

    def backward(config, saved, grads, needs, **params):
        out = impl.backward(config, saved, grads, needs, **params)
        if config["backward_plan"] == "token_chunks":
            out["weight"] = out["weight"] * (1 + 2**-10)
        return out

    fake = dataclasses.replace(impl, name="torch.fake_plan", backward=backward)
    monkeypatch.setitem(registry._REGISTRY, fake.name, fake)
    verdict = verify_config(fake, c, "float32", sizes, {"backward_plan": "token_chunks"})
    assert not verdict.ok and verdict.moved == ("backward_plan",)


def _need(impl, h, w, plan, config=None):
    call = CallInfo(
        DeviceInfo("cpu"), "float32", {"T": h.shape[0], "H": h.shape[1], "V": w.shape[0]}, {}
    )
    return implementation(impl).plan_memory(call, {**(config or {})})[plan]


def test_memory_budget_picks_a_plan_that_fits_and_explain_says_what_it_costs():
    h, w, t = head_inputs(T=40, H=16, V=300)
    lean = _need("torch.strict_ce", h, w, "vocab_chunks")
    heavy = _need("torch.strict_ce", h, w, "token_chunks")
    assert lean < heavy  # the float32 [V, H] buffer
    args = ("linear_cross_entropy", h, w, t)
    r = dispatch.explain(*args, backend="torch", plan="token_chunks")
    assert r.plan == "token_chunks" and r.config["backward_plan"] == "token_chunks"
    assert r.plan_memory == {"vocab_chunks": lean, "token_chunks": heavy}
    assert "backward plan: token_chunks" in str(r) and "the plans give the same bits" in str(r)
    r = dispatch.explain(*args, backend="torch", plan="token_chunks", memory_budget=heavy)
    assert r.plan == "token_chunks"
    for budget in (heavy - 1, lean):  # only the lean plan fits: it runs, explain names the budget
        r = dispatch.explain(*args, backend="torch", memory_budget=budget)
        assert r.plan == "vocab_chunks" and "budget" in str(r)
    with pytest.raises(ContractViolation, match=r"'memory_budget'.*too small for any backward"):
        dispatch.explain(*args, memory_budget=lean - 1)
    with pytest.raises(ContractViolation, match=r"'memory_budget'.*too small for plan 'token_"):
        dispatch.op(args[0], plan="token_chunks", memory_budget=heavy - 1)(h, w, t)
    # through the op: the budget holds in the backward, provenance names the plan and bytes
    hh = h.clone().requires_grad_()
    dispatch.op(args[0], backend="torch", memory_budget=heavy - 1)(hh, w, t).backward()
    prov = dispatch.last_provenance()
    assert (prov.backward_plan, prov.backward_bytes) == ("vocab_chunks", lean)


@pytest.mark.parametrize(
    "op,kw,match",
    [
        ("linear_cross_entropy", {"plan": "rows"}, r"'plan'.*no plan 'rows'.*vocab_chunks"),
        ("linear_cross_entropy", {"memory_budget": -1}, r"'memory_budget'.*negative"),
        ("linear_cross_entropy", {"memory_budget": 1.5e9}, r"'memory_budget'.*int number"),
        ("rms_norm", {"plan": "token_chunks"}, r"'plan'.*declares no plans"),
        ("rms_norm", {"memory_budget": 2**30}, r"'memory_budget'.*no plans"),
    ],
)
def test_bad_plan_requests(op, kw, match):
    with pytest.raises(ContractViolation, match=match):
        dispatch.op(op, **kw)


def test_relaxed_implementation_without_plans_refuses_a_plan():
    h, w, t = head_inputs()
    with pytest.raises(ContractViolation, match=r"'plan'.*torch.eager_ce offers no backward"):
        dispatch.explain(
            "linear_cross_entropy", h, w, t, backend="torch.eager_ce", mode="relaxed",
            plan="token_chunks",
        )  # fmt: skip


def test_sweep_pins_the_plan_when_timing_the_forward_and_keeps_the_budget():
    impl = implementation("triton.fused")
    canonical = impl.default_config(CallInfo(DeviceInfo("cpu"), "bfloat16", {"T": 8}, {}))
    sizes = {"H": 6656, "V": 202048}
    fwd = SweepOp(op="softcap_logprob", implementation=impl.name, sizes=sizes, batch=[8192])
    assert study_space(fwd, impl, canonical) == {
        "backward_plan": ["vocab_chunks"],
        "token_chunk": [canonical["token_chunk"]],
    }
    train = fwd.model_copy(update={"objective": "train", "memory_budget": 2 * 2**30})
    assert study_space(train, impl, canonical) is None  # the whole space, plans included
    over = _budget_check(train, impl, DeviceInfo("cpu"), "bfloat16", {**sizes, "T": 8192})
    assert over({"backward_plan": "vocab_chunks"}) is None  # 0.29 GB
    assert "token_chunks needs" in over({"backward_plan": "token_chunks", "token_chunk": 256})

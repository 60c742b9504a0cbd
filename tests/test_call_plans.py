"""Call plans: after one no-grad call of a signature, dispatch runs the implementation's plan
for it (the host wrapper's work done once); every other call, and every call a plan turns
down, takes the full path. On the CPU the plan is a recording one around the torch
implementation; the Triton plans run on the GPU (test_call_plans_gpu.py)."""

import dataclasses

import pytest
import torch

from opcontract import dispatch
from opcontract.backends import registry
from opcontract.dispatch import call_cache


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_cache.clear()
    yield
    call_cache.clear()


def _recording_plan(monkeypatch, name: str, decline: bool = False):
    """Replace ``name``'s plan_no_grad with one that records what it was made from and each
    call it serves (running the implementation's own no-grad forward on the flattened
    inputs, then shaping the outputs as the caller's)."""
    impl = registry.implementation(name)
    made, served = [], []

    def make(config, inputs, params, lead):
        made.append((dict(inputs), dict(params), lead))
        names = tuple(inputs)

        def run(*tensors):
            served.append(tensors)
            if decline:
                return None
            flat = {
                n: (t.reshape(-1, *t.shape[len(lead) :]) if lead and t is not None else t)
                for n, t in zip(names, tensors, strict=True)
            }
            out = (impl.forward_no_grad or impl.forward)(config, **flat, **params)
            return tuple(
                t.reshape(*lead, *t.shape[1:]) if lead and t is not None and t.dim() else t
                for t in out
            )

        return run

    monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(impl, plan_no_grad=make))
    return made, served


def _rms_inputs(*lead, H=48):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*lead, H, generator=g), torch.randn(H, generator=g) * 0.1


def test_plan_made_after_one_call_then_serves_the_signature(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(5)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        first = rms(x, w, variant="plain", eps=1e-5)
        assert len(made) == 1 and not served
        prov = dispatch.last_provenance()
        x2 = torch.randn_like(x)
        second = rms(x2, w, variant="plain", eps=1e-5)
        assert len(served) == 1 and served[0][0] is x2
        assert dispatch.last_provenance() == prov
    assert torch.equal(first, rms(x, w, variant="plain", eps=1e-5))
    call_cache.clear()  # the full path again, on the second inputs
    with torch.no_grad():
        assert torch.equal(second, rms(x2, w, variant="plain", eps=1e-5))
    assert len(made) == 2


def test_plan_gets_leading_dims_and_keeps_them(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(2, 3)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        full = rms(x, w, variant="plain", eps=1e-5)
        planned = rms(x, w, variant="plain", eps=1e-5)
    assert made[0][2] == (2, 3) and made[0][0]["x"].shape == (6, 48)
    assert served[0][0].shape == (2, 3, 48)
    assert planned.shape == (2, 3, 48) and torch.equal(planned, full)


def test_declined_call_takes_the_full_path(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm", decline=True)
    x, w = _rms_inputs(4)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        full = rms(x, w, variant="plain", eps=1e-5)
        again = rms(x, w, variant="plain", eps=1e-5)
    assert len(served) == 1 and torch.equal(again, full)


def test_grad_autocast_and_keywords_never_take_the_plan(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(4)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        rms(x, w, variant="plain", eps=1e-5)  # makes the plan
    wp = w.clone().requires_grad_()
    y = rms(x, wp, variant="plain", eps=1e-5)  # the same signature; wp needs a gradient
    y.sum().backward()
    assert wp.grad is not None and not served
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        rms(x, w, variant="plain", eps=1e-5)
    assert not served
    with torch.no_grad():
        rms(x, weight=w, variant="plain", eps=1e-5)  # an input by keyword: no plan made
        rms(x, weight=w, variant="plain", eps=1e-5)
    assert len(made) == 1 and not served
    with torch.no_grad():
        rms(x, w, variant="plain", eps=1e-5)
    assert len(served) == 1


def test_absent_inputs_are_passed_as_none(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_gemm")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 32, generator=g), torch.randn(16, 32, generator=g)
    gemm = dispatch.op("dense_gemm", backend="torch")
    with torch.no_grad():
        full = gemm(x, w)
        planned = gemm(x, w)
    assert len(served) == 1 and served[0][2] is None and torch.equal(planned, full)


def test_value_checked_ops_plan_only_with_host_values_and_check_them_every_call(monkeypatch):
    """Index values on the host: the plan is made, and dispatch checks the values before
    every call it serves (an out-of-range target still raises, naming the argument)."""
    from opcontract import ContractViolation

    made, served = _recording_plan(monkeypatch, "torch.strict")
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(4, 32, generator=g), torch.randn(50, 32, generator=g)
    t = torch.randint(0, 50, (4,), generator=g)
    f = dispatch.op("softcap_logprob", backend="torch.strict")
    with torch.no_grad():
        want = f(h, w, t)
        assert torch.equal(f(h, w, t), want)
        assert len(made) == 1 and len(served) == 1
        bad = t.clone()
        bad[2] = 50
        with pytest.raises(ContractViolation, match="targets"):
            f(h, w, bad)
    assert len(served) == 1  # the check ran first: the plan never saw the bad call


def _count_keys(monkeypatch) -> list:
    built = []
    key = call_cache.key

    def counting(*a):
        built.append(a)
        return key(*a)

    monkeypatch.setattr(call_cache, "key", counting)
    return built


def test_repeated_signature_is_served_without_a_memo_key(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(4)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        full = rms(x, w, variant="plain", eps=1e-5)  # full path, makes the plan
        rms(x, w, variant="plain", eps=1e-5)  # the plan via the memo: the fast entry made
        built = _count_keys(monkeypatch)
        x2 = torch.randn_like(x)
        fast = [rms(x2, w, variant="plain", eps=1e-5) for _ in range(3)]
    assert not built and len(served) == 4 and served[-1][0] is x2
    assert all(torch.equal(y, rms(x2, w, variant="plain", eps=1e-5)) for y in fast)
    assert torch.equal(full, rms(x, w, variant="plain", eps=1e-5))
    assert dispatch.last_provenance().implementation == "torch.strict_norm"


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "eps value", "eps type", "variant", "keyword missing", "device state"],
)
def test_fast_entry_misses_on_any_other_signature(monkeypatch, change):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(4)
    rms = dispatch.op("rms_norm", backend="torch")
    kw = {"variant": "plain", "eps": 1e-5}
    with torch.no_grad():
        rms(x, w, **kw)
        rms(x, w, **kw)
    args, kw2 = (x, w), dict(kw)
    if change == "shape":
        args = (torch.randn(5, 48), w)
    elif change == "dtype":
        args = (x.bfloat16(), w.bfloat16())
    elif change == "eps value":
        kw2["eps"] = 1e-6
    elif change == "eps type":
        kw2["eps"] = 1  # an int, not 1.0: the memo keys on the type too
    elif change == "variant":
        kw2["variant"] = "centred"
    elif change == "keyword missing":
        del kw2["eps"]
    elif change == "device state":
        call_cache.clear()  # the memo emptied: the fast entry is stale with it
    built = _count_keys(monkeypatch)
    with torch.no_grad():
        y = rms(*args, **kw2)
    assert built, "the call took the fast entry of another signature"
    ref = dispatch.op("rms_norm", backend="torch")  # a new OpFunction, the memo emptied
    call_cache.clear()
    with torch.no_grad():
        assert torch.equal(y, ref(*args, **kw2))


def test_alternating_signatures_compile_each_fast_entry_once(monkeypatch):
    """Prefill then decode, call after call: each signature's matcher is compiled once and
    taken again when the signature comes back."""
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    (long, w), (short, _) = _rms_inputs(7), _rms_inputs(1)
    rms = dispatch.op("rms_norm", backend="torch")
    compiled = []
    matcher = call_cache._matcher
    monkeypatch.setattr(call_cache, "_matcher", lambda *a: compiled.append(a) or matcher(*a))
    with torch.no_grad():
        for _ in range(3):
            for x in (long, short, short):
                rms(x, w, variant="plain", eps=1e-5)
        assert len(compiled) == 2
        built = _count_keys(monkeypatch)
        n = len(served)
        y = rms(short, w, variant="plain", eps=1e-5)
    assert not built and len(served) == n + 1
    call_cache.clear()
    with torch.no_grad():
        assert torch.equal(y, dispatch.op("rms_norm", backend="torch")(short, w, eps=1e-5))


def test_fast_entry_not_taken_with_grad_or_in_simulate(monkeypatch):
    made, served = _recording_plan(monkeypatch, "torch.strict_norm")
    x, w = _rms_inputs(4)
    rms = dispatch.op("rms_norm", backend="torch")
    with torch.no_grad():
        rms(x, w, variant="plain", eps=1e-5)
        rms(x, w, variant="plain", eps=1e-5)
    n = len(served)
    built = _count_keys(monkeypatch)
    wp = w.clone().requires_grad_()
    y = rms(x, wp, variant="plain", eps=1e-5)
    assert y.requires_grad and built and len(served) == n
    with torch.no_grad(), dispatch.simulate(None, type="cpu"):
        rms(x, w, variant="plain", eps=1e-5)
    assert len(served) == n


def test_positional_none_input_takes_the_plan_and_the_fast_entry(monkeypatch):
    """A module's ``gemm(x, self.weight, self.bias)`` with no bias: the plan serves it."""
    made, served = _recording_plan(monkeypatch, "torch.strict_gemm")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 32, generator=g), torch.randn(16, 32, generator=g)
    gemm = dispatch.op("dense_gemm", backend="torch")
    with torch.no_grad():
        full = gemm(x, w, None)
        gemm(x, w, None)
        built = _count_keys(monkeypatch)
        fast = gemm(x, w, None)
    assert len(served) == 2 and served[-1][2] is None and not built
    assert torch.equal(fast, full) and torch.equal(full, gemm(x, w))
    bias = torch.randn(16, generator=g)
    with torch.no_grad():
        y = gemm(x, w, bias)  # a tensor where the fast entry has None: the memo path
    assert built  # the key was built for the biased call
    call_cache.clear()
    with torch.no_grad():
        assert torch.equal(y, dispatch.op("dense_gemm", backend="torch")(x, w, bias))

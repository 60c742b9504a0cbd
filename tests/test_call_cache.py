"""The dispatch memo: a repeated call signature skips validation and selection, and gives
exactly what the slow path gives; anything that could change the answer misses."""

import dataclasses

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, NoBackendError, dispatch
from opcontract.backends import registry
from opcontract.dispatch import call_cache
from opcontract.dispatch.device import simulate
from opcontract.tables import db


@pytest.fixture(autouse=True)
def _fresh_memo():
    call_cache.clear()
    yield
    call_cache.clear()


def _spy(monkeypatch):
    calls = []
    real = dispatch.bind

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(dispatch, "bind", counting)
    return calls


def test_repeated_signature_binds_once_and_matches(monkeypatch):
    calls = _spy(monkeypatch)
    h, w, t = head_inputs()
    f = dispatch.op("softcap_logprob")
    first = f(h, w, t, softcap=20.0)
    p1 = dispatch.last_provenance()
    h2 = torch.randn_like(h)  # new values, same signature
    second = f(h2, w, t, softcap=20.0)
    assert len(calls) == 1
    assert dispatch.last_provenance() == p1
    assert torch.equal(first, f(h, w, t, softcap=20.0))
    assert not torch.equal(first, second)
    # a fresh OpFunction shares the memo
    dispatch.op("softcap_logprob")(h, w, t, softcap=20.0)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda h, w, t: ((h[:3], w, t[:3]), {"softcap": 20.0}),  # another shape
        lambda h, w, t: ((h.bfloat16(), w.bfloat16(), t), {"softcap": 20.0}),  # another dtype
        lambda h, w, t: ((h, w, t), {"softcap": 30.0}),  # another param value
        lambda h, w, t: ((h, w, t), {"softcap": 20}),  # another param type
        lambda h, w, t: ((h, w), {"targets": t, "softcap": 20.0}),  # by keyword
    ],
)
def test_other_signatures_miss(monkeypatch, change):
    calls = _spy(monkeypatch)
    h, w, t = head_inputs()
    dispatch.op("softcap_logprob")(h, w, t, softcap=20.0)
    args, kwargs = change(h, w, t)
    out = dispatch.op("softcap_logprob")(*args, **kwargs)
    assert len(calls) == 2
    assert torch.equal(out, dispatch.op("softcap_logprob")(*args, **kwargs))
    assert len(calls) == 2


def test_violations_still_raised_after_a_hit():
    h, w, t = head_inputs()
    f = dispatch.op("softcap_logprob")
    f(h, w, t)
    with pytest.raises(ContractViolation, match="'weight'"):
        f(h, w[:, :-1], t)
    bad = t.clone()
    bad[0] = w.shape[0]  # same signature, value out of range
    with pytest.raises(ContractViolation, match=r"'targets'.*values"):
        f(h, w, bad)
    ignored = t.clone()
    ignored[1] = -100  # the allowed ignore_index passes the fast range check
    f(h, w, ignored, ignore_index=-100)


def test_embedding_range_checked_on_every_call():
    table = torch.randn(7, 40)
    f = dispatch.op("normalized_embedding")
    f(torch.tensor([1, 6]), table)
    with pytest.raises(ContractViolation, match=r"'ids'.*\[0, 7\).*e\.g\. 7"):
        f(torch.tensor([1, 7]), table)
    with pytest.raises(ContractViolation, match=r"'ids'.*e\.g\. -1"):
        f(torch.tensor([-1, 2]), table)


def test_registry_change_misses(monkeypatch):
    h, w, t = head_inputs()
    f = dispatch.op("softcap_logprob")
    f(h, w, t)
    for name in ("torch.strict", "triton.fused"):
        impl = registry._REGISTRY[name]
        monkeypatch.setitem(
            registry._REGISTRY, name, dataclasses.replace(impl, invariances=("run_to_run",))
        )
    with pytest.raises(NoBackendError, match="'batch' invariance"):
        f(h, w, t)
    monkeypatch.undo()
    f(h, w, t)
    assert dispatch.last_provenance().implementation == "torch.strict"


def test_tuning_reload_and_env_miss(monkeypatch, tmp_path):
    calls = _spy(monkeypatch)
    h, w, t = head_inputs()
    f = dispatch.op("softcap_logprob")
    f(h, w, t)
    db.reload()
    f(h, w, t)
    monkeypatch.setenv(db.ENV, str(tmp_path / "t.json"))
    f(h, w, t)
    assert len(calls) == 3


def test_simulated_calls_bypass_the_memo():
    h, w, t = head_inputs()
    dispatch.op("softcap_logprob")(h, w, t)
    with simulate((9, 0)):
        r = dispatch.explain("softcap_logprob", h, w, t)
    assert r.device.startswith("simulated GPU")
    assert call_cache.key(("x", None, "strict", ""), (object(),), {}) is None


def test_module_parameters_take_the_memo_and_the_eager_fast_path(monkeypatch):
    """A model's weights are nn.Parameter: a repeated call binds once and, without grad,
    skips the library op, as with plain tensors (and gives the same bits)."""
    from opcontract.dispatch import shell

    calls = _spy(monkeypatch)
    library = []
    real = shell.OpShell.call_forward

    def counting(self, *a, **k):
        library.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(shell.OpShell, "call_forward", counting)
    h, _, _ = head_inputs()
    w = torch.nn.Parameter(torch.randn(h.shape[1]))
    f = dispatch.op("rms_norm")
    with torch.no_grad():
        first = f(h, w, variant="plain", eps=1e-5)
        for _ in range(3):
            assert torch.equal(f(h, w, variant="plain", eps=1e-5), first)
    assert len(calls) == 1 and not library
    assert torch.equal(f(h, w.detach(), variant="plain", eps=1e-5), first)
    out = f(h, w, variant="plain", eps=1e-5)  # grad on: the library op, autograd recorded
    assert library and out.requires_grad and torch.equal(out.detach(), first)

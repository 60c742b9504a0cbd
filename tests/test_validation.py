"""Bad input is a ContractViolation naming the argument, never a wrong number or a crash."""

import pytest
import torch
from helpers import head_inputs

from opcontract import ContractViolation, dispatch
from opcontract.backends.torch.softcap_logprob import reference

slp = dispatch.op("softcap_logprob")


def _violation(match, *args, **kw):
    with pytest.raises(ContractViolation, match=match) as e:
        slp(*args, **kw)
    assert isinstance(e.value, ValueError)
    return e.value


def test_wrong_rank():
    h, w, t = head_inputs()
    e = _violation(r"'hidden'.*inputs\.hidden\.shape.*rank 2", h[None], w, t)
    assert e.argument == "hidden"


def test_mismatched_h():
    h, w, t = head_inputs()
    _violation(r"'weight'.*shape\[1\].*H = 95 here but H = 96 from 'hidden'", h, w[:, :95], t)


def test_mismatched_t():
    h, w, t = head_inputs()
    _violation(r"'targets'.*T = 5 here but T = 6", h, w, t[:5])


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int64])
def test_hidden_dtype_outside_contract(dtype):
    h, w, t = head_inputs()
    _violation(r"'hidden'.*inputs\.hidden\.dtype", h.to(dtype), w.to(dtype), t)


def test_mixed_dtypes():
    h, w, t = head_inputs()
    _violation(r"'weight'.*dtype of 'hidden' \(float32\), got bfloat16", h, w.bfloat16(), t)


def test_float_targets():
    h, w, t = head_inputs()
    _violation(r"'targets'.*inputs\.targets\.dtype", h, w, t.float())


@pytest.mark.parametrize("bad", [600, 10_000, -1, -101])
def test_targets_out_of_range(bad):
    h, w, t = head_inputs()
    t[0] = bad
    _violation(r"'targets'.*inputs\.targets\.values.*\[0, 600\) or ignore_index=-100", h, w, t)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_checked(cap):
    h, w, t = head_inputs()
    _violation(r"'softcap'.*params\.softcap\.check", h, w, t, softcap=cap)


def test_param_types():
    h, w, t = head_inputs()
    _violation(r"'softcap'.*must be float, got str", h, w, t, softcap="20")
    _violation(r"'ignore_index'.*must be int", h, w, t, ignore_index=1.5)
    _violation(r"'multiplier'.*check", h, w, t, multiplier=float("nan"))


def test_different_devices():
    h, w, t = head_inputs()
    _violation(r"'weight'.*device.*meta", h, w.to("meta"), t)


def test_signature_errors():
    h, w, t = head_inputs()
    _violation(r"'temperature'.*unexpected argument", h, w, t, temperature=1.0)
    _violation(r"'targets'.*missing", h, w)
    _violation(r"positional", h, w, t, 20.0)
    _violation(r"'hidden'.*must be a torch.Tensor", h.numpy(), w, t)


def test_non_contiguous_inputs_are_handled():
    h, w, t = head_inputs(T=8)
    wt = w.T.contiguous().T  # same values, column-major
    hs = torch.cat([h, h], dim=1)[:, ::2]  # strided rows
    assert not wt.is_contiguous() and not hs.is_contiguous()
    expect = slp(hs.contiguous(), w, t, softcap=20.0)
    assert torch.equal(slp(hs, wt, t, softcap=20.0), expect)


def test_empty_batch_and_ignored_rows():
    h, w, t = head_inputs(T=0)
    out = slp(h, w, t)
    assert out.shape == (0,) and out.dtype == torch.float32
    h, w, t = head_inputs(T=4, ignore=(0, 2))
    out = slp(h, w, t, softcap=20.0)
    assert out[0].item() == 0.0 and out[2].item() == 0.0 and (out[[1, 3]] < 0).all()


def test_int32_targets_and_custom_ignore_index():
    h, w, t = head_inputs(ignore=())
    t[2] = 7
    out = slp(h, w, t.int(), ignore_index=7)
    assert out[2].item() == 0.0
    ref = reference(h, w, t, ignore_index=7)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6

"""PEFT LoRA on a patched tiny random Muse Glimmer (opcontract.integrations.lora): the base
projections and both adapter products through dense_gemm, composed in PEFT's order.

Checked: parity of loss, log-probs and every LoRA gradient with the stock PEFT model in
float64; train = rollout bitwise (0 mismatches) through a PeftModel, in a batch and alone;
``disable_adapter()`` gives the base model's bits; merged adapters run patched; PEFT applied
after patching is refused until ``apply_opcontract`` runs again; LoRA on the head or the
embedding and LoRA variants (DoRA) are refused naming the module; TRL's GRPOTrainer and
SFTTrainer with ``peft_config`` train the adapters through opcontract's head.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

from opcontract.integrations.parity import parity  # noqa: E402
from opcontract.integrations.tiny import EOS, left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractPatchError,
    apply_opcontract,
    generate_with_logprobs,
    is_patched,
    token_logprobs,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "o_proj", "up_proj", "down_proj"]
N_LORA = 4 * 8 * 2  # 4 layers x 8 projections (gate_proj: attention's and the MLP's) x A, B


def lora_config(**kw) -> LoraConfig:
    base = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                task_type="CAUSAL_LM")  # fmt: skip
    base.update(kw)
    return LoraConfig(**base)


def lora_model(dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    """A PeftModel over the tiny model; lora_B drawn random (PEFT's init is zeros: the
    adapters would add nothing)."""
    model = get_peft_model(tiny_muse_glimmer(seed=seed, eos_token_id=EOS), lora_config(**kw))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.to(dtype)


def test_lora_parity_with_stock_peft_float64():
    ids, mask = left_padded([2, 6, 3], seed=11)
    r = parity(lora_model, ids, mask, dtype=torch.float32, backend="torch")
    lora_grads = {k: v for k, v in r["grad"].items() if "lora_" in k}
    assert len(lora_grads) == N_LORA
    assert not [k for k in r["grad"] if "lora_" not in k]  # the base weights are frozen
    assert r["loss"]["max_abs_diff"] <= 1e-6
    assert r["log_probs"]["max_abs_diff"] <= 2e-5
    worst = {k: v["max_abs_diff"] / v["ref_max_abs"] for k, v in lora_grads.items()}
    bad = {k: f"{v:.2e}" for k, v in worst.items() if v > 5e-5}
    assert not bad, bad


@pytest.mark.parametrize(
    "backend, dtype",
    [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)],
)
def test_lora_rollout_equals_training_bitwise(backend, dtype, monkeypatch):
    """generate_with_logprobs through a PeftModel (sampled, left-padded, mixed lengths) =
    token_logprobs of the finished sequences, and each sequence alone = in the batch. Triton
    runs under the interpreter on the CPU."""
    if backend == "triton" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_opcontract(lora_model(dtype), backend=backend)
    assert is_patched(model)
    ids, mask = left_padded([3, 9, 5, 12])
    torch.manual_seed(0)
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=8, do_sample=True)
    P = ids.shape[1]
    with torch.no_grad():
        tr = token_logprobs(model, ro.sequences, ro.attention_mask)[:, P - 1 :]
        assert int((tr != ro.logprobs).sum()) == 0
        for b in range(ids.shape[0]):
            alone = token_logprobs(model, ro.sequences[b : b + 1], ro.attention_mask[b : b + 1])
            assert torch.equal(alone[:, P - 1 :], tr[b : b + 1])


def test_lora_adapters_change_the_output_and_disable_gives_the_base_bits():
    model = apply_opcontract(lora_model(), backend="torch")
    base = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    ids, mask = left_padded([4, 7])
    with torch.no_grad():
        with_lora = token_logprobs(model, ids, mask)
        with model.disable_adapter():
            without = token_logprobs(model, ids, mask)
        assert torch.equal(without, token_logprobs(base, ids, mask))
        assert not torch.equal(with_lora, without)


def test_merged_adapters_run_patched():
    model = apply_opcontract(lora_model(), backend="torch")
    ids, mask = left_padded([4, 7])
    with torch.no_grad():
        before = token_logprobs(model, ids, mask)
        model.merge_adapter()
        merged = token_logprobs(model, ids, mask)
        model.unmerge_adapter()  # W + d - d: PEFT restores the weights up to rounding
        torch.testing.assert_close(token_logprobs(model, ids, mask), before, atol=1e-5, rtol=0)
        unloaded = model.merge_and_unload()  # the patched nn.Linear base layers come back
        assert torch.equal(token_logprobs(unloaded, ids, mask), merged)
    torch.testing.assert_close(merged, before, atol=2e-5, rtol=0)


def test_peft_after_patching_is_refused_until_patched_again():
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    pm = get_peft_model(model, lora_config())
    ids, mask = left_padded([4, 7])
    with pytest.raises(OpcontractPatchError, match=r"layers\.0\.self_attn\.q_proj is peft"):
        pm(input_ids=ids, attention_mask=mask)
    with pytest.raises(OpcontractPatchError, match="already patched with backend='torch'"):
        apply_opcontract(pm)  # another backend than the first patch's: refused, nothing changed
    assert apply_opcontract(pm, backend="torch") is pm
    late = pm
    early = apply_opcontract(get_peft_model(tiny_muse_glimmer(eos_token_id=EOS), lora_config()),
                             backend="torch")  # fmt: skip
    with torch.no_grad():
        assert torch.equal(token_logprobs(late, ids, mask), token_logprobs(early, ids, mask))


@pytest.mark.parametrize(
    "targets, name",
    [
        (["lm_head"], "lm_head"),
        (["q_proj", "lm_head"], "lm_head"),
        (["embed_tokens"], "embed_tokens"),
    ],
)
def test_lora_on_the_head_or_embedding_is_refused(targets, name):
    before = get_peft_model(tiny_muse_glimmer(), lora_config(target_modules=targets))
    with pytest.raises(OpcontractPatchError, match=name):
        apply_opcontract(before, backend="torch")
    assert not is_patched(before)  # nothing changed
    after = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    after = get_peft_model(after, lora_config(target_modules=targets))
    ids, mask = left_padded([4, 7])
    with pytest.raises(OpcontractPatchError, match="q_proj" if "q_proj" in targets else name):
        after(input_ids=ids, attention_mask=mask)
    with pytest.raises(OpcontractPatchError, match=name):
        apply_opcontract(after, backend="torch")  # refused: q_proj stays unpatched too
    with pytest.raises(OpcontractPatchError):
        after(input_ids=ids, attention_mask=mask)


def test_lora_variants_and_mixed_adapter_batches_are_refused():
    dora = get_peft_model(tiny_muse_glimmer(), lora_config(use_dora=True))
    with pytest.raises(OpcontractPatchError, match="LoRA variant"):
        apply_opcontract(dora, backend="torch")
    assert not is_patched(dora)
    model = apply_opcontract(lora_model(), backend="torch").eval()
    ids, mask = left_padded([4, 7])
    with pytest.raises(OpcontractPatchError, match="adapter_names"):
        model(input_ids=ids, attention_mask=mask, adapter_names=["default", "default"])


def test_lora_gradients_reach_only_the_adapters():
    model = apply_opcontract(lora_model(), backend="torch").train()
    ids, mask = left_padded([4, 7])
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    text = {n for n, p in model.named_parameters() if p.requires_grad and "vision" not in n}
    assert got == text  # the vision tower's LoRA layers take no part in a text forward
    assert all("lora_" in n for n in got) and len(got) == N_LORA
    assert all(float(model.get_parameter(n).grad.abs().sum()) > 0 for n in got)


# -- TRL: a trainer given peft_config --------------------------------------------------------

trl = pytest.importorskip("trl")

from test_hf_trl import (  # noqa: E402
    check_fused_calls,
    chunked_calls,  # noqa: F401  (a fixture)
    grpo_trainer,
    record_fused_calls,
    sft_trainer,
)

from opcontract.integrations import trl as oc_trl  # noqa: E402


def _lora_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_trainer_with_peft_config_trains_adapters_through_opcontract(kind, chunked_calls):  # noqa: F811
    """The model is patched first; the trainer wraps it in PEFT; enable() patches the LoRA
    layers and serves TRL's head on the PeftModel's model."""
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = lora_config()
    if kind == "grpo":
        trainer = grpo_trainer(model, bf16=False, peft_config=cfg)
    else:
        trainer = sft_trainer(model, bf16=False, peft_config=cfg)
    assert isinstance(trainer.model, peft.PeftModel)
    oc_trl.enable(trainer, backend="torch")
    inner = trainer.model.get_base_model()
    assert oc_trl.is_enabled(trainer.model) and inner is model
    before = _lora_weights(trainer.model)
    seen = record_fused_calls(inner, bf16=False)
    trainer.train()
    assert chunked_calls == []
    check_fused_calls(seen, top1=kind == "sft")
    after = _lora_weights(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the adapters trained
    for n, p in model.named_parameters():  # the base weights did not
        if "lora_" not in n:
            key = n.replace(".base_layer", "")
            assert torch.equal(p.detach(), base[key]), n

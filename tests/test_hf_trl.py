"""TRL 1.16's SFTTrainer and GRPOTrainer on a patched tiny random Muse Glimmer, real trainer
steps on the CPU (no network: a word-level tokenizer and the datasets are built here).

``opcontract.integrations.trl.enable(trainer)`` replaces the fused head TRL installs at
trainer init (``add_fused_lm_head``, its ``ChunkedLogProbFunction``) with opcontract's
``softcap_logprob``. Checked on every ``fused_lm_head=True`` call the trainer makes: its
``log_probs`` equal :func:`token_logprobs` of the same model and inputs bitwise, its
``entropy`` and ``is_top1`` equal the op's own; the logged ``mean_token_accuracy`` and
``entropy`` are those values reduced as the trainer reduces them; TRL's chunked head is
never called (and is, on the same trainer without ``enable``: the negative control).
TRL's default ``bf16=True`` on the CPU trains under bfloat16 autocast; the references run
under the same autocast.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

import trl.trainer.utils as trl_utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS  # noqa: E402

from opcontract.integrations import trl as oc_trl  # noqa: E402
from opcontract.integrations.tiny import (  # noqa: E402
    EOS,
    VOCAB,
    left_padded,
    tiny_muse_glimmer,
    tiny_tokenizer,
)
from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractPatchError,
    apply_opcontract,
    generate_with_logprobs,
    is_patched,
    logprob_head,
    token_logprobs,
)

COMMON = dict(report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
              disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip


@pytest.fixture
def chunked_calls(monkeypatch):
    """Counts calls of TRL's own chunked head (a spy: it still runs)."""
    calls = []
    orig = trl_utils._ChunkedLogProbFunction.apply

    def spy(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", spy)
    return calls


def _autocast(bf16: bool):
    if bf16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def record_fused_calls(model, bf16: bool, temperature: float = 1.0) -> list[dict]:
    """For each fused_lm_head=True call: what the trainer got and what opcontract's functions
    give on the same model (same weights, same inputs, same autocast), right then."""
    seen: list[dict] = []

    def hook(module, args, kwargs, out):
        if not kwargs.get("fused_lm_head"):
            return
        ids, mask, labels = kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"]
        tgt = labels[:, 1:]
        with torch.no_grad(), _autocast(bf16):
            ref_lp = token_logprobs(module, ids, mask, backend="torch", temperature=temperature)
            hidden = module.model(input_ids=ids, attention_mask=mask, use_cache=False)
            hidden = hidden.last_hidden_state[:, :-1]
            keep = tgt != -100
            ref = logprob_head(module, hidden[keep], tgt[keep], entropy=True, predicted=True,
                               backend="torch", temperature=temperature, mean_logits=True,
                               log_sum_sq_probs=True)  # fmt: skip
        seen.append(dict(out=out, keep=keep, tgt=tgt, ref_lp=ref_lp.masked_fill(~keep, 0.0),
                         ref=ref, ids=ids, mask=mask, hidden=hidden[keep],
                         weight=module.lm_head.weight.detach().clone()))  # fmt: skip

    model.register_forward_hook(hook, with_kwargs=True)
    return seen


def check_fused_calls(seen: list[dict], *, top1: bool) -> None:
    assert seen, "the trainer made no fused_lm_head=True call"
    for s in seen:
        out, keep, ref = s["out"], s["keep"], s["ref"]
        assert out.log_probs.dtype == torch.float32
        assert torch.equal(out.log_probs.detach(), s["ref_lp"])  # == token_logprobs, bitwise
        if out.entropy is not None:  # what the trainer asked for (GRPO's reference: log_probs)
            assert torch.equal(out.entropy.detach()[keep], ref.entropy)
            assert bool((out.entropy[~keep] == 0).all())
        if top1:
            assert torch.equal(out.is_top1[keep], ref.predicted == s["tgt"][keep])
            assert not bool(out.is_top1[~keep].any())
        if out.mean_logits is not None:  # DPO's and KTO's logits metrics
            assert torch.equal(out.mean_logits[keep], ref.mean_logits)
            assert bool((out.mean_logits[~keep] == 0).all())
        if out.log_sum_sq_probs is not None:  # DPO's WPO weights: no gradient
            assert not out.log_sum_sq_probs.requires_grad
            assert torch.equal(out.log_sum_sq_probs[keep], ref.log_sum_sq_probs)
            assert bool((out.log_sum_sq_probs[~keep] == 0).all())


def sft_dataset(n_rows: int = 8) -> Dataset:
    """Rows whose continuations are the (same seed's) model's own greedy tokens, so that the
    first step's token accuracy is neither 0 nor 1."""
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    ids, mask = left_padded([2, 3, 4, 2, 3, 4, 2, 3][:n_rows], seed=5)
    out = generate_with_logprobs(model, ids, mask, max_new_tokens=6, do_sample=False)
    rows = [out.sequences[b][out.attention_mask[b].bool()].tolist() for b in range(len(ids))]
    return Dataset.from_list([{"input_ids": r} for r in rows])


def sft_trainer(model, bf16: bool, peft_config=None) -> SFTTrainer:
    args = SFTConfig(output_dir="/tmp/opcontract-sft", max_steps=2, per_device_train_batch_size=4,
                     learning_rate=1e-3, bf16=bf16, **COMMON)  # fmt: skip
    return SFTTrainer(model=model, args=args, train_dataset=sft_dataset(),
                      processing_class=tiny_tokenizer(), peft_config=peft_config)  # fmt: skip


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-autocast", "fp32"])
def test_sft_trainer_through_opcontract(bf16, chunked_calls):
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = sft_trainer(model, bf16)
    assert trainer.args.gradient_checkpointing  # TRL's default: the patched layers checkpoint
    assert oc_trl.enable(trainer, backend="torch") is trainer and oc_trl.is_enabled(model)
    seen = record_fused_calls(model, bf16)
    trainer.train()
    assert chunked_calls == []
    assert len(seen) == 2  # one training forward a step
    check_fused_calls(seen, top1=True)
    for s, log in zip(seen, [r for r in trainer.state.log_history if "loss" in r], strict=True):
        keep, ref = s["keep"], s["ref"]
        n = keep.sum()
        acc = ((ref.predicted == s["tgt"][keep]).sum() / n).item()
        assert log["mean_token_accuracy"] == acc
        assert log["entropy"] == (s["out"].entropy.detach().sum() / n).item()
        assert log["loss"] == pytest.approx((-ref.logprob.sum() / n).item(), rel=1e-6)
    accs = [r["mean_token_accuracy"] for r in trainer.state.log_history if "loss" in r]
    assert 0.0 < accs[0] < 1.0, accs


def test_sft_trainer_without_enable_runs_trls_chunked_head(chunked_calls):
    """Negative control: the same trainer, not enabled, goes through TRL's own head."""
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = sft_trainer(model, bf16=False)
    trainer.args.max_steps = 1
    trainer.train()
    assert len(chunked_calls) >= 1


def grpo_trainer(model, peft_config=None, **overrides) -> GRPOTrainer:
    """8 completions a step: 4 prompts of 1-4 words (left-padded by the trainer), 2 each,
    sampled by the model's own generate() (no vLLM)."""
    g = torch.Generator().manual_seed(3)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))
               for n in (1, 4, 2, 3)]  # fmt: skip

    def reward(completions, **kwargs):  # prefer low token ids
        return [-sum(int(w[1:]) for w in c.split()) / 100 for c in completions]

    kw = dict(output_dir="/tmp/opcontract-grpo", max_steps=1, per_device_train_batch_size=8,
              num_generations=2, max_completion_length=6, learning_rate=1e-4, **COMMON)  # fmt: skip
    kw.update(overrides)
    return GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**kw),
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                       processing_class=tiny_tokenizer(), peft_config=peft_config)  # fmt: skip


def test_grpo_trainer_through_opcontract(chunked_calls, tmp_path):
    """TRL's defaults (bf16 autocast, gradient checkpointing), and a reference model (beta >
    0) that accelerate prepared at init. float32: test_grpo_trainer_rollout_logprobs_..."""
    bf16 = True
    model = tiny_muse_glimmer(eos_token_id=EOS)
    model.save_pretrained(tmp_path)  # beta > 0: GRPO loads a reference model from the path
    model.config._name_or_path = str(tmp_path)
    apply_opcontract(model, backend="torch")
    trainer = grpo_trainer(model, bf16=bf16, beta=0.04)
    assert trainer.ref_model is not None
    oc_trl.enable(trainer, backend="torch")
    assert is_patched(trainer.ref_model) and oc_trl.is_enabled(trainer.ref_model)
    seen = record_fused_calls(model, bf16)
    seen_ref = record_fused_calls(trainer.ref_model, bf16)
    trainer.train()
    assert chunked_calls == []
    check_fused_calls(seen, top1=False)
    check_fused_calls(seen_ref, top1=False)
    masks = [s["out"].label_mask for s in seen]
    # the rollouts were left-padded prompts of mixed lengths; only completions are scored
    ids_mask = [s["keep"] for s in seen]
    assert all(m.shape[0] == 8 for m in masks) and any(bool((~m).any()) for m in ids_mask)
    assert all(s["out"].entropy is not None for s in seen)  # GRPO's policy asks for entropy
    assert all(s["out"].entropy is None for s in seen_ref)
    assert trainer.state.log_history[0]["reward_std"] > 0  # a step with a gradient


@pytest.mark.parametrize(
    "cache, temperature", [(None, 1.0), ("static", 1.0), (None, 0.7)],
    ids=["dynamic", "static", "dynamic-t0.7"],
)
def test_grpo_trainer_rollout_logprobs_equal_the_trainers(cache, temperature):
    """The completions the GRPO trainer sampled, replayed through generate_with_logprobs
    (each step forced to the trainer's token): the rollout's log-probs equal the trainer's
    log_probs bitwise. ``static``: GRPOConfig(cache_implementation="static"), the trainer's
    generation and the replay through OpcontractStaticCache. ``t0.7``: GRPO samples and
    scores at temperature 0.7; the replay records log-probs at that temperature."""
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = grpo_trainer(model, bf16=False, cache_implementation=cache, temperature=temperature)
    oc_trl.enable(trainer, backend="torch")
    seen, built = [], []

    def hook(module, args, kwargs, out):
        if kwargs.get("fused_lm_head"):
            # whether the trainer's own generate() built the static cache (before the replay)
            built.append(getattr(module, "_opcontract_static_cache", None) is not None)
            module.eval()  # generation in eval mode, as the trainer generates
            try:  # the weights the trainer used, before its optimizer step
                ro = _forced_rollout(module, kwargs, cache_implementation=cache,
                                     logprob_temperature=temperature)  # fmt: skip
            finally:
                module.train()
            seen.append((kwargs["input_ids"], kwargs["labels"], out.log_probs.detach(), ro))

    model.register_forward_hook(hook, with_kwargs=True)
    trainer.train()
    assert seen
    assert built[0] == (cache == "static")
    for ids, labels, lp, ro in seen:
        P = ids.shape[1] - ro.logprobs.shape[1]
        scored = labels[:, 1:] != -100
        assert bool(scored[:, P - 1 :].any())
        got = lp[:, P - 1 :]
        real = scored[:, P - 1 :]
        assert torch.equal(ro.sequences, ids)
        assert torch.equal(got[real], ro.logprobs[real])


def _forced_rollout(model, kwargs, **generate_kwargs):
    """generate_with_logprobs from the trainer's prompt part, each new token forced to the
    trainer's completion token (a logits processor: the recorded log-prob is the model's)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ids, mask, labels = kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"]
    first = int((labels != -100).int().argmax(dim=1).min())  # the completions' first column
    prompt, pmask = ids[:, :first], mask[:, :first]
    target = ids[:, first:]

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            t = target[:, input_ids.shape[1] - first]
            forced = torch.full_like(scores, -float("inf"))
            return forced.scatter(1, t[:, None], 0.0)

    return generate_with_logprobs(
        model, prompt, pmask, max_new_tokens=target.shape[1], min_new_tokens=target.shape[1],
        do_sample=False, logits_processor=LogitsProcessorList([Force()]), eos_token_id=None,
        **generate_kwargs,
    )  # fmt: skip


def test_enable_serves_trls_temperature():
    """GRPO at temperature 0.7: the head scores softmax(z / 0.7), as TRL's does: log_probs
    bitwise token_logprobs(temperature=0.7), and against TRL's own chunked head on the same
    model within float32 rounding (a negative control: not the temperature-1 values)."""
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = grpo_trainer(model, bf16=False, temperature=0.7)
    ids, mask = left_padded([3, 5])
    labels = ids.masked_fill(mask == 0, -100)
    trls = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    oc_trl.enable(trainer)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    keep = labels[:, 1:] != -100
    assert torch.equal(out.log_probs[keep], token_logprobs(model, ids, mask,
                                                           temperature=0.7)[keep])  # fmt: skip
    assert torch.allclose(out.log_probs, trls.log_probs, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.entropy, trls.entropy, rtol=1e-5, atol=1e-5)
    cold = token_logprobs(model, ids, mask)[keep]
    assert (out.log_probs[keep] - cold).abs().max() > 1e-3


def test_enable_patches_an_unpatched_model_and_is_idempotent(chunked_calls):
    model = tiny_muse_glimmer(eos_token_id=EOS)
    trainer = sft_trainer(model, bf16=False)
    oc_trl.enable(trainer, backend="torch")
    assert is_patched(model) and oc_trl.is_enabled(model)
    head = model.forward
    assert oc_trl.enable(trainer) is trainer and model.forward is head
    ids, mask = left_padded([3, 5])
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert torch.equal(out.log_probs, token_logprobs(model, ids, mask).masked_fill(
        labels[:, 1:] == -100, 0.0))  # fmt: skip
    assert chunked_calls == []


def test_enable_refuses_outputs_it_does_not_serve_and_changes_nothing():
    """A trainer whose fused head was asked for an output opcontract does not serve (every
    field TRL 1.16 computes is served: a later TRL's, say)."""
    assert set(oc_trl.SERVED) == {"log_probs", *OPTIONAL_OUTPUTS}
    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = sft_trainer(model, bf16=False)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "top_k_probs"))
    trls = model.forward
    with pytest.raises(OpcontractPatchError, match="top_k_probs"):
        oc_trl.enable(trainer)
    assert model.forward is trls and not oc_trl.is_enabled(model)


def test_enable_refuses_wpo_with_a_vocabulary_parallel_head():
    """DPO's use_weighting asks for log_sum_sq_probs, which the vocabulary-parallel head does
    not serve: enable refuses it by name before changing anything."""
    from opcontract.integrations.transformers import SHARDED_HEAD

    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    trainer = sft_trainer(model, bf16=False)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "log_sum_sq_probs"))
    setattr(model, SHARDED_HEAD, object())  # never reached
    trls = model.forward
    with pytest.raises(OpcontractPatchError, match=r"\['log_sum_sq_probs'\] with a vocab"):
        oc_trl.enable(trainer)
    assert model.forward is trls and not oc_trl.is_enabled(model)


def test_rloo_trainer_through_opcontract(chunked_calls, tmp_path):
    """RLOO at temperature 0.8 with a reference model (beta 0.05, loaded from the path):
    policy and reference log-probs bitwise token_logprobs(temperature=0.8), entropy the
    op's; TRL's chunked head never runs."""
    model = tiny_muse_glimmer(eos_token_id=EOS)
    model.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    apply_opcontract(model, backend="torch")
    g = torch.Generator().manual_seed(3)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))
               for n in (1, 4, 2, 3)]  # fmt: skip

    def reward(completions, **kwargs):
        return [-sum(int(w[1:]) for w in c.split()) / 100 for c in completions]

    args = RLOOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8,
                      num_generations=2, max_completion_length=6, learning_rate=1e-4,
                      temperature=0.8, beta=0.05, bf16=False, **COMMON)  # fmt: skip
    trainer = RLOOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tiny_tokenizer())  # fmt: skip
    assert trainer.ref_model is not None
    oc_trl.enable(trainer)
    seen = record_fused_calls(model, False, temperature=0.8)
    seen_ref = record_fused_calls(trainer.ref_model, False, temperature=0.8)
    trainer.train()
    assert chunked_calls == []
    check_fused_calls(seen, top1=False)
    check_fused_calls(seen_ref, top1=False)
    assert trainer.state.log_history[0]["reward_std"] > 0


def preference_words(n: int, g: torch.Generator) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def _saved_tiny(tmp_path):
    """A tiny model saved at tmp_path (the trainers load their reference model from it)."""
    model = tiny_muse_glimmer(eos_token_id=EOS)
    model.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    return apply_opcontract(model, backend="torch")


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_preference_trainers_through_opcontract(kind, chunked_calls, tmp_path):
    """DPO (log_probs, entropy, mean_logits, is_top1) and KTO (log_probs, entropy,
    mean_logits), each with a reference model: every fused call bitwise the op's; the logged
    logits/chosen is the mean of mean_logits over the chosen completions' tokens, and the
    mean_logits agree with the mean over the patched model's own float32 logits within
    float32 rounding. TRL's chunked head never runs."""
    model = _saved_tiny(tmp_path)
    g = torch.Generator().manual_seed(7)
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
              bf16=False, **COMMON)  # fmt: skip
    if kind == "dpo":
        rows = [{"prompt": preference_words(n, g), "chosen": preference_words(3, g),
                 "rejected": preference_words(2, g)} for n in (1, 4, 2, 3)]  # fmt: skip
        trainer = DPOTrainer(model=model, args=DPOConfig(**kw), processing_class=tiny_tokenizer(),
                             train_dataset=Dataset.from_list(rows))  # fmt: skip
    else:
        rows = [{"prompt": preference_words(n, g), "completion": preference_words(3, g),
                 "label": n % 2 == 0} for n in (1, 4, 2, 3)]  # fmt: skip
        trainer = KTOTrainer(model=model, args=KTOConfig(**kw), processing_class=tiny_tokenizer(),
                             train_dataset=Dataset.from_list(rows))  # fmt: skip
    assert trainer.ref_model is not None
    oc_trl.enable(trainer)
    seen = record_fused_calls(model, False)
    seen_ref = record_fused_calls(trainer.ref_model, False)
    trainer.train()
    assert chunked_calls == []
    check_fused_calls(seen, top1=kind == "dpo")
    check_fused_calls(seen_ref, top1=False)
    assert all(s["out"].mean_logits is not None for s in seen)
    s = seen[0]  # the same inputs again, after the step: the weights both calls see
    ids, mask, keep = s["ids"], s["mask"], s["keep"]
    labels = torch.cat([ids[:, :1], s["tgt"]], dim=1)
    with torch.no_grad():
        mean = model(input_ids=ids, attention_mask=mask, labels=labels,
                     fused_lm_head=True).mean_logits  # fmt: skip
        full = model.eval()(input_ids=ids, attention_mask=mask).logits[:, :-1]
    model.train()
    assert torch.allclose(mean[keep], full[keep].mean(-1), rtol=0, atol=1e-5)
    log = trainer.state.log_history[0]
    assert "logits/chosen" in log and log["loss"] > 0


def test_dpo_use_weighting_through_opcontract(chunked_calls, tmp_path):
    """DPO with use_weighting=True (WPO) asks its fused head for log_sum_sq_probs as well:
    a real trainer step through opcontract's head (TRL's chunked head never called), every
    fused call's log_sum_sq_probs bitwise the op's (softcap_logprob's
    return_log_sum_sq_probs), zero where the label is ignored, without a gradient; on the
    hidden states and weights of each call, within 1e-5 of TRL's own chunked computation
    (torch.log(sq_sum_exp) - 2 * torch.log(sum_exp) over its cuBLAS/CPU-BLAS tiles) and of
    log sum_v p^2 from float64 logits; the logged loss is the WPO-weighted one computed from
    those values."""
    from opcontract.backends.torch.softcap_logprob import reference

    model = _saved_tiny(tmp_path)
    g = torch.Generator().manual_seed(11)
    rows = [{"prompt": preference_words(n, g), "chosen": preference_words(3, g),
             "rejected": preference_words(2, g)} for n in (1, 4, 2, 3)]  # fmt: skip
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                     bf16=False, use_weighting=True, **COMMON)  # fmt: skip
    trainer = DPOTrainer(model=model, args=args, processing_class=tiny_tokenizer(),
                         train_dataset=Dataset.from_list(rows))  # fmt: skip
    assert "log_sum_sq_probs" in oc_trl._trl_request(model, "trainer.model")[0]
    oc_trl.enable(trainer)
    seen = record_fused_calls(model, False)
    seen_ref = record_fused_calls(trainer.ref_model, False)
    trainer.train()
    assert chunked_calls == []
    check_fused_calls(seen, top1=True)
    check_fused_calls(seen_ref, top1=False)
    assert seen and all(s["out"].log_sum_sq_probs is not None for s in seen)
    assert all(s["out"].log_sum_sq_probs is None for s in seen_ref)  # the reference: log_probs
    text = model.config.text_config
    head = dict(multiplier=text.output_multiplier, softcap=text.final_logit_softcapping)
    for s in seen:
        keep, hidden, weight = s["keep"], s["hidden"], s["weight"]
        got = s["out"].log_sum_sq_probs[keep]
        tgt = s["tgt"][keep]
        with torch.no_grad():
            trls = trl_utils._ChunkedLogProbFunction.apply(
                hidden, weight, None, tgt, 1.0, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE,
                head["softcap"], head["multiplier"], ("log_probs", "log_sum_sq_probs"),
            )[2]  # fmt: skip
        exact = reference(hidden.double(), weight.double(), tgt, return_log_sum_sq_probs=True,
                          **head).log_sum_sq_probs  # fmt: skip
        assert got.dtype == torch.float32 and got.shape == trls.shape
        assert float((got.double() - exact).abs().max()) <= 1e-5
        assert float((got - trls).abs().max()) <= 1e-5
        assert float((trls.double() - exact).abs().max()) <= 1e-5
    # the step's loss is WPO's: the policy is the reference at step 1, so each pair's sigmoid
    # loss is log 2, weighted by exp(mean over its completion of log_probs - log_sum_sq_probs)
    # for the chosen and the rejected completion (DPOTrainer's use_weighting branch)
    out, keep = seen[0]["out"], seen[0]["keep"]
    mean = ((out.log_probs.detach() - out.log_sum_sq_probs) * keep).sum(1) / keep.sum(1)
    chosen, rejected = mean.exp().chunk(2)
    wpo = math.log(2) * (chosen * rejected).mean().item()
    log = trainer.state.log_history[0]
    assert "logits/chosen" in log and 0 < wpo < 0.5 * math.log(2)
    assert log["loss"] == pytest.approx(wpo, rel=1e-6)

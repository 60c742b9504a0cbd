"""What a rollout stores: generate_with_logprobs records each generated token's log-prob from
opcontract's head as it is sampled (softcap_logits' logits[y] - lse, softcap_logprob's bits),
and it is torch.equal to the training forward's (token_logprobs over the finished
sequences), per token: left-padded batches of mixed prompt lengths, batch 1 and N, greedy
and sampled, float32 and bfloat16, with and without the KV cache.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractPatchError,
    apply_opcontract,
    generate_with_logprobs,
    token_logprobs,
)

LENS = [2, 7, 4, 5]
NEW = 8


def train_logprobs(model, ro, prompt_width: int) -> torch.Tensor:
    with torch.no_grad():
        lp = token_logprobs(model, ro.sequences, ro.attention_mask, backend="torch")
    return lp[:, prompt_width - 1 :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_rollout_logprobs_equal_training(dtype, sample):
    model = apply_opcontract(tiny_muse_glimmer(dtype), backend="torch")
    ids, mask = left_padded(LENS)
    kw = dict(max_new_tokens=NEW, do_sample=sample)
    torch.manual_seed(0)
    ro = generate_with_logprobs(model, ids, mask, **kw)
    assert ro.logprobs.shape == (len(LENS), NEW) and ro.logprobs.dtype == torch.float32
    assert bool((ro.logprobs < 0).all()) and bool(ro.completion_mask.all())
    train = train_logprobs(model, ro, ids.shape[1])
    differ = int((ro.logprobs != train).sum())
    assert differ == 0, f"{differ} of {train.numel()} tokens differ"
    # the comparison sees a change: the padding read as real tokens moves the bits
    with torch.no_grad():
        moved = token_logprobs(model, ro.sequences, torch.ones_like(ro.attention_mask))
    assert bool((moved[:, ids.shape[1] - 1 :] != train).any())
    for b in range(len(LENS)):  # batch 1, the row still left-padded to the batch's width
        torch.manual_seed(b)
        ro1 = generate_with_logprobs(model, ids[b : b + 1], mask[b : b + 1], **kw)
        assert torch.equal(ro1.logprobs, train_logprobs(model, ro1, ids.shape[1]))
        if not sample:  # the same greedy tokens, the same bits as inside the batch
            assert torch.equal(ro1.sequences[0], ro.sequences[b])
            assert torch.equal(ro1.logprobs[0], ro.logprobs[b])


def test_rollout_without_the_kv_cache():
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    cached = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    plain = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=False,
                                   use_cache=False)  # fmt: skip
    assert torch.equal(plain.sequences, cached.sequences)
    assert torch.equal(plain.logprobs, cached.logprobs)
    assert torch.equal(plain.logprobs, train_logprobs(model, plain, ids.shape[1]))


def test_rollout_logprob_is_the_models_distribution_under_a_temperature():
    """Sampling at temperature 0.7 with top-k: the recorded log-prob is the model's own
    (before the logits processors), which is what the trainer computes."""
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    torch.manual_seed(1)
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=True,
                                temperature=0.7, top_k=20)  # fmt: skip
    assert torch.equal(ro.logprobs, train_logprobs(model, ro, ids.shape[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_records_logprobs_at_the_sampling_temperature(dtype):
    """logprob_temperature=0.7: each sampled token's log-prob of softmax(z / 0.7), equal to
    the training forward's at that temperature (token_logprobs(temperature=0.7)), bitwise,
    in the batch and alone; the temperature-1 values differ (the comparison sees it)."""
    model = apply_opcontract(tiny_muse_glimmer(dtype), backend="torch")
    ids, mask = left_padded(LENS)
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.7, logprob_temperature=0.7)
    torch.manual_seed(2)
    ro = generate_with_logprobs(model, ids, mask, **kw)
    with torch.no_grad():
        train = token_logprobs(model, ro.sequences, ro.attention_mask, backend="torch",
                               temperature=0.7)[:, ids.shape[1] - 1 :]  # fmt: skip
    assert torch.equal(ro.logprobs, train)
    assert bool((ro.logprobs != train_logprobs(model, ro, ids.shape[1])).all())
    torch.manual_seed(5)
    ro1 = generate_with_logprobs(model, ids[1:2], mask[1:2], **kw)
    with torch.no_grad():
        train1 = token_logprobs(model, ro1.sequences, ro1.attention_mask, backend="torch",
                                temperature=0.7)[:, ids.shape[1] - 1 :]  # fmt: skip
    assert torch.equal(ro1.logprobs, train1)
    with pytest.raises(ValueError, match="logprob_temperature"):
        generate_with_logprobs(model, ids, mask, max_new_tokens=2, logprob_temperature=0.0)


def test_completion_mask_stops_after_eos():
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    greedy = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=False)
    eos = int(greedy.sequences[0, ids.shape[1] + 2])  # row 0's third new token ends it
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=eos, pad_token_id=0)  # fmt: skip
    comp = ro.sequences[:, ids.shape[1] :]
    assert ro.completion_mask[0].tolist()[:3] == [1, 1, 1]
    for b in range(len(LENS)):
        hits = (comp[b] == eos).nonzero().flatten().tolist()
        n = hits[0] + 1 if hits else comp.shape[1]
        assert ro.completion_mask[b].tolist() == [1] * n + [0] * (comp.shape[1] - n)
    train = train_logprobs(model, ro, ids.shape[1])
    real = ro.completion_mask.bool()
    assert torch.equal(ro.logprobs[real], train[real])


def test_generate_with_logprobs_refuses_what_it_cannot_record():
    ids, mask = left_padded(LENS)
    with pytest.raises(OpcontractPatchError, match="not patched"):
        generate_with_logprobs(tiny_muse_glimmer(), ids, mask, max_new_tokens=2)
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    with pytest.raises(ValueError, match="num_beams=2"):
        generate_with_logprobs(model, ids, mask, max_new_tokens=2, num_beams=2)
    from transformers import GenerationConfig

    config = GenerationConfig(num_beams=3, max_new_tokens=2)  # beams from the config too
    with pytest.raises(ValueError, match="num_beams=3"):
        generate_with_logprobs(model, ids, mask, generation_config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_with_several_samples_per_prompt(dtype):
    """num_return_sequences=3, sampled: generate repeats each left-padded prompt; every
    sampled token's recorded log-prob equals the training forward's over the finished rows
    (each with its prompt's mask), bitwise."""
    model = apply_opcontract(tiny_muse_glimmer(dtype), backend="torch")
    ids, mask = left_padded(LENS)
    torch.manual_seed(3)
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, do_sample=True,
                                num_return_sequences=3)  # fmt: skip
    assert ro.sequences.shape == (3 * len(LENS), ids.shape[1] + NEW)
    assert torch.equal(ro.sequences[:, : ids.shape[1]], ids.repeat_interleave(3, dim=0))
    assert torch.equal(ro.attention_mask[:, : ids.shape[1]], mask.repeat_interleave(3, dim=0))
    assert ro.logprobs.shape == (3 * len(LENS), NEW)
    assert torch.equal(ro.logprobs, train_logprobs(model, ro, ids.shape[1]))
    assert len({tuple(r) for r in ro.sequences.tolist()}) > len(LENS)  # the samples differ


def test_rollout_equals_trls_trainer_and_stock_does_not():
    """What make demo shows: sampled rollouts of a left-padded batch against TRL 1.16's
    fused_lm_head=True log-probs over the same sequences (bfloat16). Stock (generate's
    output_logits, TRL's chunked head): every token differs here; patched: none."""
    from opcontract.integrations.parity import train_rollout_mismatches

    kw = dict(trainer_head="trl", lengths=(3, 9, 5), new_tokens=6)
    stock = train_rollout_mismatches(torch.bfloat16, patched=False, **kw)
    patched = train_rollout_mismatches(torch.bfloat16, patched=True, **kw)
    assert patched["differ"] == 0 and patched["tokens"] == 18
    assert stock["differ"] > 0, stock


def test_token_logprobs_takes_the_patched_backend_by_default(monkeypatch):
    """A model patched with backend="triton" (the interpreter on the CPU): token_logprobs
    without a backend scores with the Triton head its generation used, so the rollout's
    log-probs equal it bitwise (the torch head's differ in the last bits here: at seed 1, 1
    of 12 tokens by 4.8e-7, what a default of dispatch's choice gave)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = apply_opcontract(tiny_muse_glimmer(seed=1), backend="triton")
    ids, mask = left_padded([3, 9, 5], seed=2)
    torch.manual_seed(1)
    ro = generate_with_logprobs(model, ids, mask, max_new_tokens=4, do_sample=True)
    P = ids.shape[1]
    with torch.no_grad():
        default = token_logprobs(model, ro.sequences, ro.attention_mask)
        triton = token_logprobs(model, ro.sequences, ro.attention_mask, backend="triton")
    assert torch.equal(default, triton)
    assert int((default[:, P - 1 :] != ro.logprobs).sum()) == 0

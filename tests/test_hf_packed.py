"""Packed (padding-free) training batches on a patched tiny Muse Glimmer: whole sequences back
to back in a row, position ids restarting at 0 for each (TRL's ``padding_free`` collator).

Each sequence's logits equal those of the sequence run alone, bitwise (local layers across
the window, fp32 and bf16); the label loss and every gradient match a padded batch of the
same sequences; TRL 1.16's SFTTrainer with ``padding_free=True`` trains through the packed
path and its log-probs are each sequence's own; what the path cannot serve (padding inside a
packed batch, a KV cache, position ids that skip) is a ValueError naming the argument.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

pytest.importorskip("transformers")

from opcontract import attention as _attention  # noqa: E402
from opcontract.integrations.positions import packing_from_position_ids  # noqa: E402
from opcontract.integrations.tiny import EOS, PAD, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import apply_opcontract, token_logprobs  # noqa: E402


def sequences(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 60, (n,), generator=g) for n in lens]


def pack(rows):
    """[B, L] input_ids and position_ids of rows of sequences, each row right-filled with
    single pad tokens at position 0 (TRL's pad_to_multiple_of)."""
    L = max(sum(len(s) for s in row) for row in rows)
    ids, pos = [], []
    for row in rows:
        n = sum(len(s) for s in row)
        ids.append(torch.cat([*row, torch.full((L - n,), PAD)]))
        pos.append(
            torch.cat([*(torch.arange(len(s)) for s in row), torch.zeros(L - n, dtype=torch.int64)])
        )
    return torch.stack(ids), torch.stack(pos)


@pytest.fixture
def packed_calls(monkeypatch):
    calls = []
    orig = _attention.packed

    def spy(*args, **kwargs):
        calls.append(args[4].tolist())
        return orig(*args, **kwargs)

    monkeypatch.setattr(_attention, "packed", spy)
    return calls


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                           ("triton", torch.bfloat16)])  # fmt: skip
def test_packed_rows_give_each_sequence_its_own_bits(backend, dtype, packed_calls):
    model = apply_opcontract(tiny_muse_glimmer(dtype), backend=backend)
    rows = [sequences([11, 3, 7], seed=1), sequences([5, 9], seed=2)]  # window 4: crossed
    ids, pos = pack(rows)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos).logits
        for b, row in enumerate(rows):
            a = 0
            for s in row:
                alone = model(input_ids=s[None]).logits[0]
                assert torch.equal(logits[b, a : a + len(s)], alone), (b, a)
                a += len(s)
    # row 1 (14 tokens) ends in 7 pad tokens, each a sequence of its own
    assert packed_calls and packed_calls[0] == [0, 11, 14, 21, 26, *range(35, 43)]


def test_packed_key_table_is_built_once_a_forward(monkeypatch):
    built = []
    orig = _attention.packed_index
    monkeypatch.setattr(_attention, "packed_index", lambda *a: built.append(1) or orig(*a))
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, pos = pack([sequences([6, 5])])
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    assert built == [1]  # four layers, both kinds: one table
    q = torch.randn(11, 4, 8)
    k = v = torch.randn(11, 2, 8)
    index = _attention.packed_index(torch.tensor([0, 6, 11]), 11, "cpu")
    with pytest.raises(Exception, match="built for 11 rows, q has 10"):
        _attention.packed(q[:10], k[:10], v[:10], q[:10], torch.tensor([0, 6, 10]),
                          layer="global", index=index)  # fmt: skip


def test_packed_labels_loss_and_gradients_match_a_padded_batch():
    """The same sequences packed in one row and right-padded in a batch: the label loss
    (first token of each sequence unlabelled, as TRL's collator marks it) and every
    parameter's gradient agree to float32 rounding (the sums over rows run in another order)."""
    seqs = sequences([9, 4, 6], seed=3)
    ids, pos = pack([seqs])
    labels = ids.clone()
    labels[pos == 0] = -100
    L = max(len(s) for s in seqs)
    pad_ids = torch.stack([torch.cat([s, torch.full((L - len(s),), PAD)]) for s in seqs])
    mask = torch.stack([torch.arange(L) < len(s) for s in seqs]).long()
    pad_labels = pad_ids.masked_fill(mask == 0, -100)
    grads = []
    for kw in (dict(input_ids=ids, position_ids=pos, labels=labels),
               dict(input_ids=pad_ids, attention_mask=mask, labels=pad_labels)):  # fmt: skip
        model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
        loss = model(**kw).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                      if p.grad is not None}))  # fmt: skip
    (l1, g1), (l2, g2) = grads
    assert torch.allclose(l1, l2, rtol=1e-6, atol=0)
    assert g1.keys() == g2.keys() and len(g1) > 20
    for n in g1:
        rel = ((g1[n] - g2[n]).norm() / g2[n].norm().clamp(min=1e-30)).item()
        assert rel < 1e-5, (n, rel)


def test_packing_from_position_ids():
    assert packing_from_position_ids(torch.arange(6)[None], 2) is None  # one sequence a row
    p = packing_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]), 1)
    assert p.cu_seqlens.tolist() == [0, 3, 5, 6] and p.positions.tolist() == [0, 1, 2, 0, 1, 0]
    with pytest.raises(ValueError, match=r"position_ids: row 0 column 2 is 3"):
        packing_from_position_ids(torch.tensor([[0, 1, 3, 0]]), 1)
    with pytest.raises(ValueError, match=r"position_ids: rows \[1\] .* do not start"):
        packing_from_position_ids(torch.tensor([[0, 1, 0, 1], [1, 2, 0, 1]]), 2)


def test_packed_batches_it_cannot_serve_are_refused():
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, pos = pack([sequences([4, 3])])
    with pytest.raises(ValueError, match="position_ids given disagree"):  # padding: the mask's
        model(input_ids=ids, position_ids=pos, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))
    with torch.no_grad():  # an all-ones mask beside packed position ids: still packed
        ones = torch.ones_like(ids)
        assert torch.equal(model(input_ids=ids, position_ids=pos, attention_mask=ones).logits,
                           model(input_ids=ids, position_ids=pos).logits)  # fmt: skip
    with pytest.raises(ValueError, match="position_ids given disagree"):  # generation's cache
        model(input_ids=ids, position_ids=pos, use_cache=True)
    with pytest.raises(ValueError, match="position_ids: row 0 column 4 is 2"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 2, 3, 4]]))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_sft_trainer_packing_through_opcontract(bf16, packed_calls):
    """TRL 1.16's SFTTrainer with packing (BFD: padding-free, one flattened row a step) and
    opcontract's head: the trainer's log-probs are each sequence's own, bitwise, and the
    packed path ran."""
    trl = pytest.importorskip("trl")
    from test_hf_trl import COMMON, sft_dataset  # noqa: PLC0415

    from opcontract.integrations import trl as oc_trl

    model = apply_opcontract(tiny_muse_glimmer(eos_token_id=EOS), backend="torch")
    args = trl.SFTConfig(output_dir="/tmp/opcontract-sft-packed", max_steps=2,
                         per_device_train_batch_size=4, learning_rate=1e-3, bf16=bf16,
                         packing=True, max_length=24, **COMMON)  # fmt: skip
    from opcontract.integrations.tiny import tiny_tokenizer

    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=sft_dataset(),
                             processing_class=tiny_tokenizer())  # fmt: skip
    oc_trl.enable(trainer, backend="torch")
    seen = []

    def hook(module, _args, kwargs, out):
        if kwargs.get("fused_lm_head"):
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
            with torch.no_grad(), autocast:  # the reference under the trainer's autocast
                ids, pos = kwargs["input_ids"], kwargs["position_ids"]
                starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
                want = [token_logprobs(module, ids[:, a:b]) for a, b in pairwise(starts)]
            seen.append((out.log_probs.detach(), starts, want, kwargs["labels"]))

    model.register_forward_hook(hook, with_kwargs=True)
    trainer.train()
    assert len(seen) == 2 and packed_calls
    compared = 0
    for lp, starts, want, labels in seen:
        assert lp.shape[0] == 1 and len(starts) > 3  # several sequences in the row
        for (a, b), w in zip(pairwise(starts), want, strict=True):
            keep = labels[0, a + 1 : b] != -100
            got = lp[0, a : b - 1]
            assert torch.equal(got[keep], w[0][keep]), (a, b)
            compared += int(keep.sum())
    assert compared > 20


def test_packed_attention_refuses_a_cache_or_tensor_parallel_replica():
    from opcontract.integrations import transformers as hf

    packing = packing_from_position_ids(torch.tensor([[0, 1, 0]]), 1)
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    gate = torch.randn(1, 3, 4, 8)
    tp = torch.nn.Module()
    tp._opcontract_attention = _attention.padded  # what opcontract.parallel sets on replicas
    with pytest.raises(hf.OpcontractPatchError, match="packed sequences"):
        hf._gated_attention(tp, q, k, v, None, gate=gate, opcontract_packing=packing)
    cache = hf.OpcontractKVCache(tiny_muse_glimmer().config)
    with pytest.raises(hf.OpcontractPatchError, match="packed sequences"):
        hf._gated_attention(torch.nn.Module(), q, k, v, None, gate=gate,
                            past_key_values=cache, opcontract_packing=packing)  # fmt: skip

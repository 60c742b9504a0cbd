"""A tiny random Muse Glimmer and a word-level tokenizer for it, built locally (no download):
what the tests, the demo and ``benchmarks/hf_parity.py`` run the integration on.

The model is the real ``MuseGlimmerForConditionalGeneration`` at a toy size: 4 layers (3
local with a small window, 1 global NoPE), GQA 4/2, head_dim 8. The stock init sets every
RMSNorm weight to 1 and draws the head small; both are redrawn so that the centred norms and
the soft cap do something. The tokenizer maps ``t3`` .. ``t{V-1}`` to ids 3 .. V - 1 (0
padding, 1 bos, 2 eos), split on whitespace.
"""

from __future__ import annotations

import torch

VOCAB = 97
PAD, BOS, EOS = 0, 1, 2


def tiny_muse_glimmer(
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    vocab: int = VOCAB,
    window: int = 4,
    eos_token_id: int | None = None,
    heads: int = 4,
    hidden: int = 32,
):
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=8, sliding_window=window,
        pad_token_id=PAD, eos_token_id=eos_token_id, bos_token_id=BOS,
        max_position_embeddings=256,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = MuseGlimmerConfig(
        text_config=text, vision_config=vision, out_hidden_size=16, projector_hidden_size=16
    )
    model = MuseGlimmerForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = PAD
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if "layernorm" in name:
                p.normal_(0.0, 0.3)
            elif name == "norm.weight":
                p.normal_(1.0, 0.3)
        model.lm_head.weight.normal_(0.0, 1.0)
    return model.to(dtype)


def tiny_tokenizer(vocab: int = VOCAB):
    """A ``PreTrainedTokenizerFast`` over ``t3`` .. ``t{vocab-1}``, padding on the left."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
    words.update({f"t{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<pad>", padding_side="left",
    )  # fmt: skip


def left_padded(lengths: list[int], *, vocab: int = VOCAB, seed: int = 1):
    """Random prompts of the given lengths, left-padded: (input_ids, attention_mask) [B, max]."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, L - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, L - n :] = 1
    return ids, mask

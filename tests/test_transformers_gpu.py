"""The transformers integration on the GPU (``pytest -m gpu``): a small Llama in bf16 with
attn_implementation="tiled_attention" against "sdpa"."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtile.integrations import transformers as ft  # noqa: E402

pytestmark = pytest.mark.gpu


def _models():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    models = {}
    for impl in ("sdpa", ft.NAME):
        torch.manual_seed(0)
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        models[impl] = transformers.LlamaForCausalLM(c).to("cuda", torch.bfloat16).eval()
    return models


def test_padded_logits_and_generation():
    models = _models()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 300), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    mask[3, :250] = 0
    with torch.no_grad():
        ref = models["sdpa"](ids, attention_mask=mask).logits.float()
        got = models[ft.NAME](ids, attention_mask=mask).logits.float()
        keep = mask.bool()
        assert (ref - got)[keep].abs().max() <= 0.1 * ref[keep].abs().max()
        a = models["sdpa"].generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
        b = models[ft.NAME].generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(a[:, :300 + 16], b[:, :300 + 16])  # bf16: the first 16 new tokens agree

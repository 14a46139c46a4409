"""Continuous batching on the GPU (``pytest -m gpu``): ``generate_batch`` of a small bf16
Llama with attn_implementation="flashtile_fa2" runs flashtile's varlen kernels (prefill,
mixed batches) and its paged kv-cache kernel (the decode fast path transformers enables on
CUDA), and every token it picks is the paged sdpa model's pick up to a near-tie (the test
of test_transformers_gpu.py: sdpa reads flashtile's tokens with teacher forcing)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtile.integrations import transformers as ft  # noqa: E402

pytestmark = pytest.mark.gpu


def _model(impl: str):
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(copy.deepcopy(config)).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation(impl)
    return model


def test_generate_batch_runs_flashtile_kernels(flash_calls):
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(20, 700, (12,), generator=g)]
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in lengths]
    new = 24
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    ours = _model(ft.FLASH_NAME)
    out = ours.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    assert flash_calls["flash_attn_varlen_func"] > 0
    assert flash_calls["flash_attn_with_kvcache"] > 0, "the decode fast path did not run flashtile's kv-cache kernel"
    results = [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.rsplit("_", 1)[-1]))]
    assert [len(t) for t in results] == [new] * len(prompts)

    sdpa = _model("sdpa")
    for prompt, tokens in zip(prompts, results):
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            ref = sdpa(ids).logits.float()[0]
            got = ours(ids).logits.float()[0]  # flashtile's varlen/flash path on the same tokens
        tol = 4 * (ref - got)[:len(prompt)].abs().max().item() + 1e-3
        forced = ref[len(prompt) - 1:-1]  # sdpa's logits where each generated token was picked
        chosen = torch.tensor(tokens, device="cuda")
        gap = forced.max(-1).values - forced.gather(-1, chosen[:, None])[:, 0]
        assert (gap <= tol).all(), (gap.max().item(), tol)

"""transformers models with attn_implementation="tiled_attention" (flashtile.integrations.
transformers) against "eager" and "sdpa" on CPU, random weights from small configs:
padded batches (left and right), packed documents, sliding windows, softcap, attention
sinks (gpt-oss), an encoder, a training step and greedy generation."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtile.integrations import transformers as ft  # noqa: E402  (registers the name)

TOL = 2e-5  # float32 on CPU: the torch twin vs transformers' eager attention


def _pair(config, cls, impls=("eager", ft.NAME)):
    models = {}
    for impl in impls:
        torch.manual_seed(0)
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        models[impl] = cls(c).eval()
    return models


def _llama():
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _qwen2():
    return transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                    layer_types=["sliding_attention", "full_attention"])


def _gemma2():
    return transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256, sliding_window=5, attn_logit_softcapping=3.0,
                                     final_logit_softcapping=None, query_pre_attn_scalar=16)


def _qwen3():
    return transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256)


CAUSAL_LMS = {"llama": (_llama, transformers.LlamaForCausalLM), "qwen2-sliding": (_qwen2, transformers.Qwen2ForCausalLM),
              "gemma2-softcap": (_gemma2, transformers.Gemma2ForCausalLM),
              "qwen3": (_qwen3, transformers.Qwen3ForCausalLM)}


def _inputs(batch=3, seqlen=20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (batch, seqlen), generator=g)
    right = torch.ones(batch, seqlen, dtype=torch.long)
    right[1, 14:] = 0
    right[2, 9:] = 0
    left = right.flip(1)
    return ids, right, left


@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_padded_batches_match_eager(name):
    make, cls = CAUSAL_LMS[name]
    models = _pair(make(), cls)
    ids, right, left = _inputs()
    with torch.no_grad():
        for mask in (None, right, left):
            ref = models["eager"](ids, attention_mask=mask).logits
            got = models[ft.NAME](ids, attention_mask=mask).logits
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            assert (ref - got)[keep].abs().max() < TOL, name


@pytest.mark.parametrize("name", list(CAUSAL_LMS))
def test_packed_documents_match_each_document_alone(name):
    make, cls = CAUSAL_LMS[name]
    models = _pair(make(), cls)
    ids, _, _ = _inputs()
    docs = [ids[0, :7], ids[1, :11], ids[2, :4]]
    packed = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        got = models[ft.NAME](packed, position_ids=position_ids).logits[0]
        ref = torch.cat([models["eager"](d[None]).logits[0] for d in docs])
    assert (got - ref).abs().max() < TOL


def test_training_step_gradients_match_eager():
    models = _pair(_llama(), transformers.LlamaForCausalLM)
    ids, right, _ = _inputs()
    grads = {}
    for impl, model in models.items():
        model.train()
        model.config.attention_dropout = 0.0
        loss = model(ids, attention_mask=right, labels=ids.masked_fill(right == 0, -100)).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads[ft.NAME].keys() and grads["eager"]
    for n, g in grads["eager"].items():
        assert (g - grads[ft.NAME][n]).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n


@pytest.mark.parametrize("name, peer", [("llama", "sdpa"), ("gemma2-softcap", "eager")])  # Gemma2: no sdpa
def test_greedy_generation_matches(name, peer):
    make, cls = CAUSAL_LMS[name]
    models = _pair(make(), cls, impls=(peer, ft.NAME))
    ids, _, left = _inputs(seqlen=12)
    with torch.no_grad():
        a = models[peer].generate(ids[:1], max_new_tokens=32, do_sample=False)
        b = models[ft.NAME].generate(ids[:1], max_new_tokens=32, do_sample=False)
        assert torch.equal(a, b)
        a = models[peer].generate(ids, attention_mask=left, max_new_tokens=16, do_sample=False)
        b = models[ft.NAME].generate(ids, attention_mask=left, max_new_tokens=16, do_sample=False)
        assert torch.equal(a, b)


def test_encoder_with_padding_mask():
    config = transformers.BertConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    models = _pair(config, transformers.BertModel)
    ids, right, _ = _inputs()
    with torch.no_grad():
        ref = models["eager"](ids, attention_mask=right).last_hidden_state
        got = models[ft.NAME](ids, attention_mask=right).last_hidden_state
    assert (ref - got)[right.bool()].abs().max() < TOL


def test_refusals_name_the_feature():
    q = torch.randn(1, 2, 4, 16)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="output_attentions"):
        ft.attention_forward(module, q, q, q, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="4-D float attention mask"):
        ft.attention_forward(module, q, q, q, torch.zeros(1, 1, 4, 4))


@pytest.mark.slow(seconds=25)
def test_the_example_runs_and_agrees_with_sdpa():
    # examples/transformers_llama.py, as a user runs it on CPU: its printed differences are
    # the claims of the README's transformers section.
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(root / "examples" / "transformers_llama.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    diffs = [float(x) for x in re.findall(r"max \|(?:logits )?diff\|[^0-9]*([0-9.e+-]+)", out)]
    assert len(diffs) == 2 and max(diffs) < 1e-4, out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) < 1e-4, out
    assert "identical True" in out, out


def _gpt_oss():
    """A small gpt-oss (sliding and full layers, learnable sinks, MoE), with the sinks of
    both models set to the same large values (around the rows' LSE: a dropped sink shows)."""
    config = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                       layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=256)
    models = _pair(config, transformers.GptOssForCausalLM)
    for model in models.values():
        g = torch.Generator().manual_seed(5)
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(4, generator=g) * 2 + 2
    return models


def test_gpt_oss_sinks_match_eager():
    models = _gpt_oss()
    ids, right, left = _inputs()
    with torch.no_grad():
        for mask in (None, right, left):
            ref = models["eager"](ids, attention_mask=mask).logits
            got = models[ft.NAME](ids, attention_mask=mask).logits
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            assert (ref - got)[keep].abs().max() < TOL
        # the sinks matter far beyond the tolerance: without them eager gives other logits
        for layer in models["eager"].model.layers:
            layer.self_attn.sinks.data.fill_(float("-inf"))
        assert (models["eager"](ids).logits - got).abs().max() > 100 * TOL


def test_gpt_oss_training_step_and_generation_match_eager():
    models = _gpt_oss()
    ids, right, left = _inputs()
    grads = {}
    for impl, model in models.items():
        model.train()
        loss = model(ids, attention_mask=right, labels=ids.masked_fill(right == 0, -100)).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.endswith("sinks") for n in grads[ft.NAME])
    assert grads["eager"].keys() == grads[ft.NAME].keys()
    for n, g in grads["eager"].items():
        assert (g - grads[ft.NAME][n]).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n
    with torch.no_grad():
        for model in models.values():
            model.eval()
        a = models["eager"].generate(ids, attention_mask=left, max_new_tokens=12, do_sample=False)
        b = models[ft.NAME].generate(ids, attention_mask=left, max_new_tokens=12, do_sample=False)
        assert torch.equal(a, b)


def _deepseek_v3():
    """MLA in its prefill form: q and k of 24 (16 without rope + 8 rope), v of 16."""
    return transformers.DeepseekV3Config(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                         qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, n_group=1,
                                         topk_group=1)


def _gemma4(k_eq_v=False):
    """Gemma 4's text layers: a sliding layer of head dim 32 and a full one of 512."""
    return transformers.Gemma4TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                                         max_position_embeddings=256, vocab_size_per_layer_input=97,
                                         hidden_size_per_layer_input=16, per_layer_config={"01": {"head_dim": 512}},
                                         attention_k_eq_v=k_eq_v)


@pytest.mark.parametrize("name", ["deepseek-v3", "gemma4", "gemma4-k-eq-v"])
def test_value_head_dims_and_head_dim_512_match_eager(name):
    """Models whose attention flashtile refused before issue 36: DeepSeek-V3 (v's head dim
    differs from q's: 'k and v must have the same shape'), Gemma 4 (head dim 512 on its
    full layers: 'head dim of q must be in [1, 256]'). Padded batches, a training step,
    greedy generation."""
    make, cls = {"deepseek-v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM),
                 "gemma4": (_gemma4, transformers.Gemma4ForCausalLM),
                 "gemma4-k-eq-v": (lambda: _gemma4(True), transformers.Gemma4ForCausalLM)}[name]
    models = _pair(make(), cls)
    ids, right, left = _inputs()
    with torch.no_grad():
        for mask in (None, right, left):
            ref = models["eager"](ids, attention_mask=mask).logits
            got = models[ft.NAME](ids, attention_mask=mask).logits
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            assert (ref - got)[keep].abs().max() < TOL
        a = models["eager"].generate(ids, attention_mask=left, max_new_tokens=8, do_sample=False)
        b = models[ft.NAME].generate(ids, attention_mask=left, max_new_tokens=8, do_sample=False)
        assert torch.equal(a, b)
    grads = {}
    for impl, model in models.items():
        model.train()
        model(ids, attention_mask=right, labels=ids.masked_fill(right == 0, -100)).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads[ft.NAME].keys() and grads["eager"]
    for n, g in grads["eager"].items():
        assert (g - grads[ft.NAME][n]).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n


def _llama4(chunk=8):
    return transformers.Llama4TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                         intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                         attention_chunk_size=chunk, num_local_experts=2, interleave_moe_layer_step=2)


def test_llama4_chunked_attention_matches_eager():
    """Llama 4's chunked layers reach the attention function only through the mask, which
    the 2-D padding mask drops (before issue 36, logits were off by ~0.75 of their largest
    value, silently): the integration passes the layer's chunk as attention_chunk, chunks
    counted from each row's first real token. Sequences of 20 tokens over chunks of 8,
    unpadded, right- and left-padded; a training step's gradients."""
    models = _pair(_llama4(chunk=8), transformers.Llama4ForCausalLM)
    assert "chunked_attention" in models[ft.NAME].config.layer_types
    ids, right, left = _inputs(seqlen=20)
    with torch.no_grad():
        for mask in (None, right, left):
            ref = models["eager"](ids, attention_mask=mask).logits
            got = models[ft.NAME](ids, attention_mask=mask).logits
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            assert (ref - got)[keep].abs().max() < TOL
        # the chunks matter far beyond the tolerance: without them the logits differ
        plain = _pair(_llama4(chunk=64), transformers.Llama4ForCausalLM)["eager"](ids).logits
        assert (plain - models["eager"](ids).logits).abs().max() > 100 * TOL
    grads = {}
    for impl, model in models.items():
        model.train()
        model(ids, attention_mask=right, labels=ids.masked_fill(right == 0, -100)).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads[ft.NAME].keys() and grads["eager"]
    for n, g in grads["eager"].items():
        assert (g - grads[ft.NAME][n]).abs().max() <= 1e-4 * max(1.0, g.abs().max().item()), n


def test_llama4_generation_past_a_chunk_matches_eager():
    """Generating past the chunk size: the chunked layers' cache keeps only the last chunk's
    worth of keys, whose positions the attention function never sees (before the mask
    builder passed such layers transformers' exact mask, greedy tokens differed from eager
    after the first chunk, with no error); single and left-padded batched prompts, and a
    prompt of more than two chunks."""
    models = _pair(_llama4(chunk=8), transformers.Llama4ForCausalLM)
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(2))
    left = torch.ones(3, 7, dtype=torch.long)
    left[1, :3] = 0
    left[2, :5] = 0
    long = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for prompt, mask in ((ids[:1, :6], None), (ids, left), (long, None)):
            a = models["eager"].generate(prompt, attention_mask=mask, max_new_tokens=14, do_sample=False)
            b = models[ft.NAME].generate(prompt, attention_mask=mask, max_new_tokens=14, do_sample=False)
            assert torch.equal(a, b)

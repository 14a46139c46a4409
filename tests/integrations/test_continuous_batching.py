"""transformers' continuous batching (``generate_batch`` over its paged KV cache) with
attn_implementation="flashtile_fa2": flashtile registered as a flash-attention
implementation (flashtile.integrations.transformers.register_flash_provider). On CPU the
functions run the torch twin; the tokens must equal the paged sdpa implementation's and
plain ``generate`` with "eager", and flashtile's functions must be the ones called:
varlen for prefill and mixed batches, the paged kv-cache function for the decode fast path
(which transformers enables on CUDA only; here it is turned on for the test)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
cb_init = pytest.importorskip("transformers.generation.continuous_batching.initialization")

from transformers import modeling_flash_attention_utils as mfa  # noqa: E402

import flashtile  # noqa: E402
from flashtile.integrations import transformers as ft  # noqa: E402  (registers both names)
from test_transformers import _llama, _qwen2  # noqa: E402  (the same small configs)


MODELS = {"llama": (_llama, transformers.LlamaForCausalLM),
          "qwen2-sliding": (_qwen2, transformers.Qwen2ForCausalLM)}
PROMPT_LENGTHS = (5, 17, 9, 30)  # arrive together, of different lengths
NEW_TOKENS = 8


def _model(which: str, impl: str):
    make_config, cls = MODELS[which]
    torch.manual_seed(0)
    config = copy.deepcopy(make_config())
    model = cls(config).eval()
    model.set_attn_implementation(impl)
    return model


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _generation_config():
    # eos -1 (never produced): every request runs its NEW_TOKENS steps
    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


@contextlib.contextmanager
def _decode_fast_path():
    """transformers turns the block-table decode path on for flash-attention 2/3 names on
    CUDA only; this pretends CUDA is there while it decides, nowhere else."""
    decide = cb_init.ensure_decode_fast_path_is_available

    def on_cpu_too(*args, **kwargs):
        with mock.patch.object(cb_init.torch.cuda, "is_available", lambda: True):
            return decide(*args, **kwargs)

    with mock.patch.object(cb_init, "ensure_decode_fast_path_is_available", on_cpu_too):
        yield


@contextlib.contextmanager
def _padded_batches():
    """What continuous batching does when it captures CUDA graphs (its default on CUDA), on
    CPU without the graphs: batches padded to static sizes, with tokens past cu_seqlens[-1]
    and decode rows of cache_seqlens -1 (ModelRunner.pad_inputs)."""
    from transformers.generation.continuous_batching import model_runner

    init = model_runner.ModelRunner.__init__

    def padded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_inputs = True

    with mock.patch.object(model_runner.ModelRunner, "__init__", padded):
        yield


def _generate_batch(model, max_batch_tokens: int, fast_path: bool, padded: bool = False):
    fields = inspect.signature(transformers.ContinuousBatchingConfig).parameters
    page = {"page_size" if "page_size" in fields else "block_size": 16}  # "block_size" before 5.17's rename
    cb = transformers.ContinuousBatchingConfig(**page, num_blocks=48, max_batch_tokens=max_batch_tokens,
                                               max_blocks_per_request=8 if fast_path else 0, use_cuda_graph=False)
    with _decode_fast_path() if fast_path else contextlib.nullcontext(), \
            _padded_batches() if padded else contextlib.nullcontext():
        out = model.generate_batch(inputs=_prompts(), generation_config=_generation_config(),
                                   continuous_batching_config=cb, progress_bar=False, warmup=False)
    assert len(out) == len(PROMPT_LENGTHS)
    return [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.rsplit("_", 1)[-1]))]


@functools.lru_cache(maxsize=None)
def _eager_tokens(which: str):
    model = _model(which, "eager")
    return [model.generate(torch.tensor([p]), generation_config=_generation_config())[0, len(p):].tolist()
            for p in _prompts()]


@functools.lru_cache(maxsize=None)
def _paged_sdpa_tokens(which: str, max_batch_tokens: int):
    return _generate_batch(_model(which, "sdpa"), max_batch_tokens, fast_path=False)


# transformers (5.25) has no block-table path for sliding-window layers: varlen only there
CASES = [("llama", False, False), ("llama", True, False), ("qwen2-sliding", False, False),
         ("llama", True, True), ("llama", False, True)]


@pytest.mark.parametrize("max_batch_tokens", [64, 24], ids=["one-prefill", "chunked-mixed"])
@pytest.mark.parametrize("which, fast_path, padded", CASES, ids=["llama", "llama-decode-fast-path", "qwen2-sliding",
                                                                 "llama-fast-path-padded", "llama-padded"])
def test_generate_batch_matches_paged_sdpa_and_eager(which, max_batch_tokens, fast_path, padded, flash_calls):
    """Padded: batches padded to static sizes, as under CUDA graphs (``_padded_batches``)."""
    tokens = _generate_batch(_model(which, ft.FLASH_NAME), max_batch_tokens, fast_path, padded)
    assert tokens == _paged_sdpa_tokens(which, max_batch_tokens)
    assert tokens == _eager_tokens(which)
    layers = MODELS[which][0]().num_hidden_layers
    assert flash_calls["flash_attn_varlen_func"] >= layers  # the prefill at least
    if fast_path:  # every decode-only step after the prompts: the paged kv-cache function
        assert flash_calls["flash_attn_with_kvcache"] >= layers * (NEW_TOKENS - 2)
    else:
        assert flash_calls["flash_attn_with_kvcache"] == 0
        assert flash_calls["flash_attn_varlen_func"] >= layers * NEW_TOKENS


def test_the_provider_resolves_flashtile_and_only_its_names():
    ft.register_flash_provider()  # idempotent: one wrapper
    assert mfa._lazy_imports.flashtile_names == {ft.FLASH_NAME}
    assert not hasattr(mfa._lazy_imports.original, "flashtile_names")
    fns = mfa._lazy_imports(ft.FLASH_NAME)
    assert fns[0] is flashtile.flash_attn_func
    for fn, api in zip(fns[1:3], (flashtile.flash_attn_varlen_func, flashtile.flash_attn_with_kvcache)):
        assert fn.func is api and fn.keywords == {"padding_sequences": True}  # continuous batching's padding
    assert [getattr(f, "func", f) for f in mfa._lazy_imports("paged|" + ft.FLASH_NAME)[:3]] == \
        [getattr(f, "func", f) for f in fns[:3]]
    with mock.patch.object(mfa._lazy_imports, "original", return_value="theirs") as original:
        assert mfa._lazy_imports("flash_attention_2") == "theirs"
        original.assert_called_once_with("flash_attention_2")
    with pytest.raises(ValueError, match="must contain 'flash'"):
        ft.register_flash_provider("tiles")


def test_plain_generate_and_padded_forward_through_the_flash_wrappers():
    """FLASH_NAME outside continuous batching: transformers' flash-attention-2 path (unpad,
    varlen, pad) on flashtile's functions, against eager."""
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    mask[2, :11] = 0
    eager, ours = _model("llama", "eager"), _model("llama", ft.FLASH_NAME)
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=2e-5)
    gen = _generation_config()
    assert torch.equal(ours.generate(ids, attention_mask=mask, generation_config=gen),
                       eager.generate(ids, attention_mask=mask, generation_config=gen))


def test_a_transformers_without_the_flash_pieces_keeps_the_other_name(monkeypatch):
    """Where transformers lacks what the flash-attention name needs, importing the
    integration still registers NAME and warns that FLASH_NAME is not registered."""
    import importlib
    import sys

    mapping = transformers.AttentionInterface._global_mapping
    monkeypatch.setitem(sys.modules, "transformers.integrations.flash_attention", None)  # import fails
    monkeypatch.delitem(mapping, ft.NAME)
    monkeypatch.delitem(mapping, ft.FLASH_NAME)
    try:
        with pytest.warns(UserWarning, match="'flashtile_fa2' .* is not registered"):
            importlib.reload(ft)
        assert ft.NAME in mapping and ft.FLASH_NAME not in mapping
    finally:
        monkeypatch.undo()
        importlib.reload(ft)
    assert ft.NAME in mapping and ft.FLASH_NAME in mapping

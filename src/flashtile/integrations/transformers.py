"""Hugging Face transformers: ``attn_implementation="tiled_attention"``.

    import flashtile.integrations.transformers  # registers on import
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tiled_attention")

transformers is imported here only (flashtile does not depend on it). ``register()`` puts
``attention_forward`` into transformers' ``AttentionInterface`` and ``build_mask`` into
``AttentionMaskInterface``: transformers' own flash-attention mask builder, so the layers
receive no mask (nothing padded) or the 2-D padding mask, except for chunked layers whose
cache dropped the sequence's first keys, which get transformers' exact 4-D bool mask. The
name has no "flash" in it on purpose: transformers (5.x) takes any name containing
"flash" for a flash-attn build and tries to import or download its kernels
(``lazy_import_flash_attention``), which fails for "flashtile", and refuses chunked
attention over more than one chunk for such names; the 2-D masks, which are what makes
flash-attention fast there, come from the mask builder instead.

What each call becomes:
    no mask, no packing        ``flash_attn_func`` (causal bottom-right, as flash-attn)
    2-D padding mask           ``unpad_input`` and ``flash_attn_varlen_func``, output padded back
    packed sequences           ``flash_attn_varlen_func`` on the flattened tokens, from the
                               ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs, or from
                               ``position_ids`` that restart (batch 1; one host read)
    sliding_window w           window (w - 1, w - 1) (causal: (w - 1, 0)), as transformers'
                               flash path converts it
    chunked attention          Llama 4's chunked layers (``attention_chunk_size``,
                               ``layer_types``): ``attention_chunk``, chunks counted from
                               each row's first real token (the unpadded sequences' first
                               key); a layer whose cache dropped the first keys gets the
                               exact mask from ``build_mask`` instead
    softcap, GQA, dropout      passed through; ``is_causal=False`` for encoders
    attention sinks            ``s_aux`` (gpt-oss's per-head ``sinks`` parameter) as
                               ``learnable_sink``, differentiable
Refused with an error naming the feature: ``output_attentions`` and a 4-D float mask
(which this mask builder never makes).

Continuous batching (``generate_batch``, transformers' paged KV cache) takes only
"paged|eager", "sdpa" or a flash-attention implementation, so flashtile also registers as
one: ``attn_implementation="flashtile_fa2"`` (``FLASH_NAME``) is flashtile's
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` behind
transformers' own flash-attention-2 wrappers, exactly as a flash-attn build or a hub kernel
would be. ``generate_batch`` then runs prefill and mixed batches on the varlen kernels over
transformers' paged cache, and decode-only batches on the paged kv-cache kernel (the block
table path, which transformers enables on CUDA for names matching "flash...2", hence the
"fa2"; a name passed to ``register_flash_provider`` without a 2 or 3 after "flash" keeps
the varlen path only). Under CUDA graphs (its default on CUDA) continuous batching pads
its batches with tokens past cu_seqlens[-1] and decode rows of cache_seqlens -1: the
functions are handed to it with ``padding_sequences=True``. How transformers finds the
functions, and what flashtile changes for it:
    transformers resolves every name containing "flash" through
    ``modeling_flash_attention_utils._lazy_imports`` (flash-attn packages by name, else a hub
    kernel through the ``kernels`` package); ``register_flash_provider()`` wraps that function
    so that ``FLASH_NAME`` (and "paged|" + ``FLASH_NAME``) resolve to flashtile's functions and
    every other name goes on as before.
    transformers < 5.23 (e.g. 5.17, on the device) switches a continuous-batching model to
    "paged|" + name and calls ``integrations.flash_paged.paged_attention_forward``: that name
    is registered too. From 5.23 the prefix is dropped and ``flash_attention_forward`` serves
    both. Checked with 5.17 and 5.25.
Use ``NAME`` for training and ``generate``: it handles chunked attention past one chunk and
gpt-oss's sinks itself, where transformers' flash path refuses or needs a vLLM kernel. A model
that lists ``_compatible_flash_implementations`` (gpt-oss) makes transformers swap any other
flash name for its own, with a warning: there ``FLASH_NAME`` is not flashtile.
"""

from __future__ import annotations

from typing import Optional

import torch

NAME = "tiled_attention"
FLASH_NAME = "flashtile_fa2"


def _window(sliding_window: Optional[int], causal: bool, key_length: int) -> tuple[int, int]:
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _attention_chunk(module: torch.nn.Module) -> Optional[int]:
    """The chunk size of a layer with chunked attention (transformers' ``layer_types``
    entry "chunked_attention" and its config's ``attention_chunk_size``), else None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        return None
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and layer is not None and layer < len(layer_types):
        return int(chunk) if layer_types[layer] == "chunked_attention" else None
    return int(chunk)


def _packed_from_position_ids(position_ids: torch.Tensor):
    """cu_seqlens (int32) and the longest document of a (1, T) position_ids whose values
    restart at 0 at each document; None if it is one increasing sequence."""
    pos = position_ids.reshape(-1)
    if pos.numel() <= 1:
        return None
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() <= 1 or int(starts[0]) != 0:
        return None
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """The function transformers calls: query (batch, heads, q_len, head_dim), key/value
    (batch, kv_heads, kv_len, head_dim); returns ((batch, q_len, heads, head_dim), None)."""
    import flashtile

    if kwargs.get("output_attentions", False):
        raise NotImplementedError("flashtile never materialises attention weights: output_attentions=True needs "
                                  "attn_implementation='eager'")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, head_dim)
    batch, q_len = q.shape[:2]
    kv_len = k.shape[1]
    window = _window(sliding_window, causal, kv_len)
    # transformers passes chunking only inside masks: the 2-D padding mask (or none) drops it,
    # so the layer's config says it; a 4-D mask (``build_mask``'s exact one) holds it already.
    chunk = _attention_chunk(module)
    common = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal, window_size=window,
                  softcap=float(softcap or 0.0), learnable_sink=s_aux, attention_chunk=chunk or 0)
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            raise NotImplementedError("flashtile: a 4-D float attention mask (a custom mask) is not supported by this "
                                      "integration; pass a 2-D padding mask or use attn_implementation='sdpa'")
        out = flashtile.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True, learnable_sink=s_aux)
        return out.transpose(1, 2), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is None and cu_q is None and batch == 1 and kwargs.get("position_ids") is not None \
            and q_len == kv_len:
        packed = _packed_from_position_ids(kwargs["position_ids"])
        if packed is not None:
            cu_q = cu_k = packed[0]
            max_q = max_k = packed[1]
    if attention_mask is None and cu_q is not None:
        out = flashtile.flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **common)
        return out.reshape(batch, q_len, *out.shape[1:]), None
    if attention_mask is None:
        return flashtile.flash_attn_func(q, k, v, **common), None

    # 2-D padding mask over the keys (batch, kv_len); the queries are its last q_len columns.
    key_mask = attention_mask[:, -kv_len:].bool()
    query_mask = key_mask[:, -q_len:]
    q_tok, q_idx, cu_q, max_q = flashtile.unpad_input(q, query_mask)
    k_tok, _, cu_k, max_k = flashtile.unpad_input(k, key_mask)
    v_tok = v.reshape(-1, *v.shape[2:])[torch.nonzero(key_mask.flatten()).flatten()]
    out = flashtile.flash_attn_varlen_func(q_tok, k_tok, v_tok, cu_q, cu_k, max(max_q, 1), max(max_k, 1), **common)
    return flashtile.pad_input(out, q_idx, batch, q_len), None


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask builder: transformers' flash-attention builder (None or the 2-D padding
    mask), except for a chunked-attention layer whose keys start past the sequence's first
    position (``kv_offset > 0``: a cache that keeps only the last chunk's worth of keys).
    There the keys' positions, which the attention function never sees, decide which keys
    share a chunk with the queries: the layer gets transformers' own exact (batch, 1,
    q_length, kv_length) bool mask (small: kv_length is at most the chunk size)."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask, sdpa_mask

    mask_function = mask_function or causal_mask_function
    chunk = getattr(kwargs.get("config"), "attention_chunk_size", None)
    if chunk and kwargs.get("local_size") == chunk and kv_offset > 0:
        kwargs = {n: v for n, v in kwargs.items() if n not in ("allow_is_causal_skip", "allow_is_bidirectional_skip")}
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         allow_is_causal_skip=False, **kwargs)
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                                **kwargs)


def register(name: str = NAME) -> str:
    """Register flashtile with transformers under ``name`` (attention function and mask
    builder); returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    assert name in ALL_MASK_ATTENTION_FUNCTIONS
    return name


def _flash_functions():
    """What transformers' ``_lazy_imports`` returns for ``FLASH_NAME``: flash_attn_func,
    flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input (transformers'
    own padding helpers, which flash-attn 3 uses too). The varlen and kv-cache functions
    take ``padding_sequences=True``: continuous batching pads its batches to static sizes
    when it captures CUDA graphs (its default on CUDA) with tokens past cu_seqlens[-1] and
    decode rows of cache_seqlens -1, which flash-attn's kernels happen to skip and
    flashtile otherwise refuses."""
    import functools

    import flashtile
    from transformers import modeling_flash_attention_utils as mfa

    return (flashtile.flash_attn_func,
            functools.wraps(flashtile.flash_attn_varlen_func)(
                functools.partial(flashtile.flash_attn_varlen_func, padding_sequences=True)),
            functools.wraps(flashtile.flash_attn_with_kvcache)(
                functools.partial(flashtile.flash_attn_with_kvcache, padding_sequences=True)),
            mfa._pad_input, mfa._unpad_input)


def register_flash_provider(name: str = FLASH_NAME) -> str:
    """Register flashtile as a flash-attention implementation of transformers under
    ``name`` (which must contain "flash": continuous batching accepts no other custom
    name). Idempotent; returns the name to pass as ``attn_implementation``."""
    if "flash" not in name:
        raise ValueError(f"name must contain 'flash' (transformers' test for a flash-attention implementation), "
                         f"got {name!r}")
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as mfa
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    # every lookup first: a transformers without one of them changes nothing
    flash_mask = ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    paged_forward = None
    if hasattr(mfa, "lazy_import_paged_flash_attention"):  # transformers < 5.23: "paged|" names of its own
        from transformers.integrations.flash_paged import paged_attention_forward as paged_forward
    names = getattr(mfa._lazy_imports, "flashtile_names", None)
    if names is None:
        original = mfa._lazy_imports
        names = set()

        def _lazy_imports(implementation, *args, **kwargs):
            if implementation is not None and implementation.removeprefix("paged|") in names:
                return _flash_functions()
            return _lazy_imports.original(implementation, *args, **kwargs)

        _lazy_imports.__doc__ = original.__doc__
        _lazy_imports.flashtile_names = names
        _lazy_imports.original = original
        mfa._lazy_imports = _lazy_imports
    names.add(name)
    AttentionInterface.register(name, flash_attention_forward)
    AttentionMaskInterface.register(name, flash_mask)
    if paged_forward is not None:
        AttentionInterface.register("paged|" + name, paged_forward)
        AttentionMaskInterface.register("paged|" + name, flash_mask)
    return name


register()
try:
    register_flash_provider()
except (ImportError, AttributeError, KeyError) as _err:  # a transformers without the flash-attention pieces
    import warnings

    warnings.warn(f"flashtile: {FLASH_NAME!r} (continuous batching) is not registered with this transformers: "
                  f"{type(_err).__name__}: {_err}; {NAME!r} is", stacklevel=2)

"""A small Llama-architecture model (random weights, nothing downloaded) with
attn_implementation="tiled_attention" (flashtile) next to "sdpa": a padded batch, a
packed batch, a training step and greedy generation; prints differences and timings.

    python examples/transformers_llama.py          # CPU: under a minute
    python examples/transformers_llama.py --cuda   # the GPU kernels, bf16
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashtile.integrations.transformers as ft  # registers "tiled_attention"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    device = "cuda" if args.cuda else "cpu"
    dtype = torch.bfloat16 if args.cuda else torch.float32
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    models = {}
    for impl in ("sdpa", ft.NAME):
        torch.manual_seed(0)
        c = copy.deepcopy(config)
        c._attn_implementation = impl
        models[impl] = LlamaForCausalLM(c).to(device, dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 128), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # left padding
    mask[3, :100] = 0
    with torch.no_grad():
        (ref, t_ref), (got, t_got) = (timed(lambda m=m: m(ids, attention_mask=mask).logits) for m in models.values())
    print(f"padded batch: max |logits diff| {(ref - got)[mask.bool()].abs().max():.2e} "
          f"(sdpa {t_ref * 1e3:.1f} ms, flashtile {t_got * 1e3:.1f} ms)")
    docs = [ids[0, :50], ids[2, :70], ids[3, 100:]]
    packed, pos = torch.cat(docs)[None], torch.cat([torch.arange(len(d), device=device) for d in docs])[None]
    with torch.no_grad():
        got = models[ft.NAME](packed, position_ids=pos).logits[0]
        ref = torch.cat([models["sdpa"](d[None]).logits[0] for d in docs])
    print(f"packed batch (3 documents, one row): max |diff| vs each document alone {(ref - got).abs().max():.2e}")
    losses = {}
    for impl, model in models.items():
        model.train()
        loss, t = timed(lambda m=model: m(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
        _, tb = timed(loss.backward)
        losses[impl] = loss.item()
        print(f"training step {impl:16s} loss {loss.item():.6f} forward {t * 1e3:.1f} ms backward {tb * 1e3:.1f} ms")
        model.eval()
    with torch.no_grad():
        (a, ta), (b, tb) = (timed(lambda m=m: m.generate(ids[:, -16:], attention_mask=torch.ones_like(ids[:, -16:]),
                                                        max_new_tokens=32, do_sample=False, pad_token_id=0))
                            for m in models.values())
    print(f"greedy generation of 32 tokens: identical {torch.equal(a, b)} (sdpa {ta:.2f} s, flashtile {tb:.2f} s)")


if __name__ == "__main__":
    main()

"""A transformers model trained and sampled with flashtile next to the other
attn_implementations (issue 18's benchmark).

A random-weight Llama-architecture model of about 1.1B parameters (bf16, hidden 2048, 16
layers, GQA 32/8, vocab 32000; nothing is downloaded) runs these workloads (the first three
by default):

* ``train-padded``: training steps (forward, backward, AdamW) on 8 x 4096 tokens, right-padded
  documents of 1024-4096 tokens with an attention mask;
* ``train-packed``: the same documents packed into one row (position_ids restart per document:
  no document attends to another), the way LLMs are trained;
* ``generate``: greedy generation of 256 tokens at batch 16 after a 2048-token prompt;
* ``train-full``: training steps on 8 full rows of 4096 tokens, no mask, so that transformers'
  "sdpa" calls SDPA with ``is_causal`` alone and PyTorch's flash backend can take it: the
  rows of issue 37's SDPA provider (impls ``sdpa`` (PyTorch's default choice), ``sdpa[flash]``
  (its flash backend forced) and ``sdpa+flashtile`` (the flashtile provider active));
* ``cb``: continuous batching, ``generate_batch`` of 64 requests with prompts of 128-2048
  tokens, 256 new tokens each, on transformers' paged cache (impls ``flashtile_fa2``, the
  flash-attention name flashtile registers, and ``sdpa``, transformers' paged sdpa);
  tokens/s counts the generated tokens.

Each attn_implementation starts from the same weights and sees the same batches. A row
gives tokens/s (real tokens, padding not counted) and the loss of every step, so that the
loss curves can be compared. Rows go to ``--out`` (JSON lines), and a summary is printed::

    PYTHONPATH=src python3 benchmarks/transformers_step.py --out rows.jsonl [--steps 20]
    PYTHONPATH=src python3 benchmarks/transformers_step.py --tiny      # CPU smoke: a tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time

import torch

IMPLS = ("tiled_attention", "sdpa", "flex_attention")
WORKLOADS = ("train-padded", "train-packed", "generate")
PROVIDER = "sdpa+flashtile"  # "sdpa" with flashtile's SDPA provider active
SDPA_FLASH = "sdpa[flash]"  # "sdpa" with PyTorch's flash backend forced


def attn_implementation(impl: str) -> str:
    return "sdpa" if impl in (PROVIDER, SDPA_FLASH) else impl


@contextlib.contextmanager
def attention_context(impl: str):
    """What runs around an impl's workloads: the provider active, or SDPA's flash backend."""
    if impl == PROVIDER:  # SDPA's flash backend forced, so that the provider takes every call
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from flashtile.integrations import torch_sdpa

        with torch_sdpa.activated(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    elif impl == SDPA_FLASH:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    else:
        yield


def make_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)


def documents(batch: int, seqlen: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """One document per row, of 1/4 .. 1 of seqlen tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(seqlen // 4, seqlen + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def padded(docs, seqlen, device):
    ids = torch.zeros(len(docs), seqlen, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, :len(d)] = d
        mask[i, :len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def packed(docs, device):
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = ids.clone()
    starts = torch.tensor([0] + [len(d) for d in docs[:-1]]).cumsum(0)
    labels[0, starts] = -100  # no next-token target across a document boundary (the shift is the model's)
    return dict(input_ids=ids.to(device), position_ids=pos.to(device), labels=labels.to(device))


def full(batch: int, seqlen: int, vocab: int, device):
    """Rows of ``seqlen`` real tokens, no mask (SDPA gets ``is_causal`` and nothing else)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batch, seqlen), generator=g).to(device)
    return dict(input_ids=ids, labels=ids)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def train(model, batch, steps: int, warmup: int, device) -> tuple[float, list[float]]:
    """Seconds per step (after ``warmup`` steps) and the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    losses, times = [], []
    model.train()
    for step in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    del opt
    return sorted(times)[len(times) // 2], losses


def generate(model, batch: int, prompt: int, new: int, vocab: int, device) -> float:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, prompt), generator=g).to(device)
    model.eval()
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        sync(device)
    assert out.shape[1] == prompt + new
    return time.perf_counter() - start


def continuous_batching(model, requests: int, prompt: tuple[int, int], new: int, vocab: int, device,
                        tiny: bool = False) -> float:
    """Seconds of one ``generate_batch`` of ``requests`` prompts (lengths uniform in
    ``prompt``), ``new`` greedy tokens each, after a small warm-up batch. transformers sizes
    the paged cache from free memory (``tiny``: a small fixed cache instead)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=128) if tiny else None

    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(prompt[0], prompt[1] + 1, (requests,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.eval()
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:4], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), continuous_batching_config=cb,
            progress_bar=False)
        sync(device)
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                   progress_bar=False)
        sync(device)
    secs = time.perf_counter() - start
    done = [len(r.generated_tokens) for r in out.values()]
    if done != [new] * requests:
        raise RuntimeError(f"generate_batch returned {len(done)} of {requests} requests, lengths {sorted(set(done))}")
    return secs


def available(impls, device) -> list[str]:
    out = []
    for impl in impls:
        if impl == "flex_attention" and device != "cuda":
            continue  # compiled kernels: GPU only
        out.append(impl)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", nargs="+", default=list(IMPLS))
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS),
                   choices=list(WORKLOADS) + ["train-full", "cb"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU in float32 (a smoke test)")
    p.add_argument("--out", help="JSON lines file for the rows")
    args = p.parse_args(argv)

    import transformers  # noqa: F401

    import flashtile.integrations.transformers  # noqa: F401  registers "tiled_attention", "flashtile_fa2"

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = make_config(args.tiny)
    batch, seqlen = (2, 128) if args.tiny else (8, 4096)
    gen_batch, prompt, new = (2, 32, 8) if args.tiny else (16, 2048, 256)
    cb_requests, cb_prompt, cb_new = (6, (8, 40), 8) if args.tiny else (64, (128, 2048), 256)
    docs = documents(batch, seqlen, config.vocab_size)
    tokens = sum(len(d) for d in docs)
    rows = []
    for impl in available(args.impl, device):
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        c = copy.deepcopy(config)
        c._attn_implementation = attn_implementation(impl)
        try:
            model = LlamaForCausalLM(c).to(device, dtype)
        except Exception as err:  # an implementation this install does not have: say so, go on
            print(f"{impl}: not available ({type(err).__name__}: {err})", flush=True)
            continue
        state = copy.deepcopy(model.state_dict())
        for workload in args.workload:
            model.load_state_dict(state)  # every workload from the same weights
            row = dict(workload=workload, impl=impl, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       dtype=str(dtype).replace("torch.", ""), params=sum(t.numel() for t in model.parameters()))
            try:
                with attention_context(impl):
                    if workload == "generate":
                        secs = generate(model, gen_batch, prompt, new, config.vocab_size, device)
                        row.update(tokens=gen_batch * new, seconds=secs, tokens_per_s=gen_batch * new / secs)
                    elif workload == "cb":
                        secs = continuous_batching(model, cb_requests, cb_prompt, cb_new, config.vocab_size, device,
                                                   tiny=args.tiny)
                        row.update(tokens=cb_requests * cb_new, seconds=secs, tokens_per_s=cb_requests * cb_new / secs)
                    else:
                        data = (padded(docs, seqlen, device) if workload == "train-padded" else packed(docs, device)
                                if workload == "train-packed" else full(batch, seqlen, config.vocab_size, device))
                        secs, losses = train(model, data, args.steps, args.warmup, device)
                        real = batch * seqlen if workload == "train-full" else tokens
                        row.update(tokens=real, seconds=secs, tokens_per_s=real / secs, losses=losses)
                if impl == PROVIDER:  # calls the provider sent back to PyTorch's own kernels (should be none)
                    from flashtile.integrations import torch_sdpa
                    row["provider_fallbacks"] = sum(torch_sdpa.FALLBACKS.values())
            except Exception as err:
                row.update(error=f"{type(err).__name__}: {err}")
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        del model, state
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    print(summary(rows))
    return 1 if any("error" in r for r in rows if r["impl"] in ("tiled_attention", "flashtile_fa2", PROVIDER)) else 0


def summary(rows) -> str:
    lines = ["| workload | impl | tokens/s | vs sdpa | first / last loss |", "|---|---|---|---|---|"]
    base = {r["workload"]: r.get("tokens_per_s") for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base[r['workload']]:.2f}x" if tps and base.get(r["workload"]) else "-"
        loss = f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}" if r.get("losses") else "-"
        lines.append(f"| {r['workload']} | {r['impl']} | {'-' if tps is None else f'{tps:,.0f}'} | {ratio} | "
                     f"{loss if 'error' not in r else r['error'][:60]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

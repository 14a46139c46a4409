"""Experiment: the warp-specialized Gluon backward (flashtile/backends/sm90/backward_split.py) in its
variants, checked against fp32 autograd and timed next to the Triton backward and cuDNN.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd.py
    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd.py --variants "4,64,2;4,128,2"

A variant is (dK/dV ring slots, dQ key tile (0: the default), dQ ring slots[, queries per
dK/dV step, 64 or 128]). "api" is the library's backward as a user calls it (delta preprocess and the default variant),
"triton" the same with FLASHTILE_WS=0. ``--split`` also times each kernel alone, in TF/s of its own tile
products (one product over all tile pairs: 2 B H S^2 D FLOPs, half the forward's; the
dK/dV kernel does 4, the dQ kernel 3).
"""

from __future__ import annotations

import argparse
import os
import sys


def ref_grads(q, k, v, dout, causal, diag):
    """fp32 autograd on (B, H, S, D) tensors; rows that see no key give 0."""
    import torch

    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = qf @ kf.repeat_interleave(rep, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    valid = torch.ones(q.shape[2], 1, device=q.device)
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        valid = (i + diag >= 0).float()
        s = s.masked_fill((j > i + diag) & (i + diag >= 0), float("-inf"))
    p = torch.softmax(s, -1) * valid
    out = p @ vf.repeat_interleave(rep, 1)
    out.backward(dout.float())
    lse = torch.logsumexp(s, -1).masked_fill(valid[:, 0] == 0, float("-inf"))
    return out, lse, qf.grad, kf.grad, vf.grad


def library_launch(q, k, v, dout, lse, delta, dq, dk, dv, *, causal, diag, variant, kernels=("dkdv", "dq")):
    """The library's kernels with variant (dK/dV ring slots, dQ key tile, dQ ring slots;
    the ring slots of d256's dV and dK kernels are fixed, so variant[0] is ignored there)."""
    from flashtile.backends.sm90.backward_split import SPLIT_HEAD_DIMS, attention_backward_ws

    dkdv_num_buf = None if q.shape[-1] in SPLIT_HEAD_DIMS else variant[0]
    block_q = variant[3] if len(variant) > 3 else 64
    attention_backward_ws(q, k, v, dout, lse, delta, dq, dk, dv, scale=q.shape[-1] ** -0.5, diag_offset=diag,
                          causal=causal, dkdv_num_buf=dkdv_num_buf, dq_block_n=variant[1], dq_num_buf=variant[2],
                          dkdv_block_q=block_q,
                          kernels=kernels)


def run(variants, shapes, split: bool = False, launch=library_launch) -> None:
    """Check every variant against fp32 autograd, then time it next to the library's
    backward ("api"), the Triton backward and cuDNN. ``launch(q, k, v, dout, lse, delta,
    dq, dk, dv, causal=, diag=, variant=[, kernels=])`` writes dq, dk, dv; ``split`` times
    the dK/dV and dQ kernels alone (needs ``kernels``)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flashtile

    def ws(q, k, v, dout, lse, delta, causal, diag, variant, **kw):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch(q, k, v, dout, lse, delta, dq, dk, dv, causal=causal, diag=diag, variant=variant, **kw)
        return dq, dk, dv

    for B, H, Hk, Sq, Sk, D, causal in ((2, 4, 2, 333, 517, 128, True), (1, 4, 4, 1000, 1000, 64, False),
                                        (2, 6, 1, 300, 129, 128, False), (1, 2, 2, 700, 200, 64, True),
                                        (1, 2, 1, 64, 64, 128, True), (1, 2, 2, 1, 300, 64, False)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        diag = Sk - Sq
        out, lse, *refs = ref_grads(q, k, v, dout, causal, diag)
        delta = (out.detach() * dout.float()).sum(-1).contiguous()
        for variant in variants:
            try:
                grads = ws(q, k, v, dout, lse.detach().contiguous(), delta, causal, diag, variant)
                torch.cuda.synchronize()
                errs = "  ".join(f"{n} {(g_.float() - r).abs().max().item():.2e}/{r.abs().max().item():.1e}"
                                 for n, g_, r in zip(("dq", "dk", "dv"), grads, refs))
                print(f"B{B} H{H}/{Hk} Sq{Sq} Sk{Sk} d{D} causal={int(causal)} {variant}: max err/|ref| {errs}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
                print(f"check failed {variant}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    for D, S, causal in shapes:
        B, H = 16384 // S, 2048 // D
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        lse = torch.randn(B, H, S, device="cuda").abs() + 5
        delta = torch.randn(B, H, S, device="cuda")
        bwd_flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        row = {}
        for variant in variants:
            try:
                ms = do_bench(lambda: ws(q, k, v, dout, lse, delta, causal, 0, variant), warmup=25, rep=100)
                row["ws" + ",".join(map(str, variant))] = bwd_flops / ms * 1e-9
                if split:  # each kernel alone, as TF/s of its own products (4 and 3 of the 7)
                    for part, n_products in (("dkdv", 4), ("dq", 3)):
                        ms_part = do_bench(lambda: ws(q, k, v, dout, lse, delta, causal, 0, variant, kernels=(part,)),
                                           warmup=25, rep=100)
                        row[f"  {part}@" + ",".join(map(str, variant))] = (bwd_flops * n_products / 5 / ms_part
                                                                           * 1e-9)
            except Exception as exc:  # noqa: BLE001
                print(f"d{D} S{S} {variant} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        qb, kb, vb = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
        do = dout.transpose(1, 2)
        for name, flag in (("api", "1"), ("triton", "0")):
            os.environ["FLASHTILE_WS"] = flag
            o = flashtile.flash_attn_func(qb, kb, vb, causal=causal)
            row[name] = bwd_flops / do_bench(lambda: torch.autograd.grad(o, (qb, kb, vb), do, retain_graph=True),
                                             warmup=25, rep=100) * 1e-9
        os.environ["FLASHTILE_WS"] = "1"
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            os_ = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            row["cudnn"] = bwd_flops / do_bench(lambda: torch.autograd.grad(os_, (qs, ks, vs), dout, retain_graph=True),
                                                warmup=25, rep=100) * 1e-9
        print(f"d{D} S{S} causal={int(causal)}: " + "  ".join(f"{k_} {v_:6.1f}" for k_, v_ in row.items())
              + " TF/s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="4,64,2;4,64,3;4,128,2",
                   help="dkdv_num_buf,dq_block_n,dq_num_buf[,dkdv_block_q];...")
    p.add_argument("--split", action="store_true", help="also time the dK/dV and dQ kernels alone")
    p.add_argument("--shapes", default="128,4096,0;128,4096,1;128,16384,1;64,4096,0;64,16384,1;64,1024,0;128,1024,1",
                   help="headdim,seqlen,causal;...")
    args = p.parse_args(argv)
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    run(variants, [(d, S, bool(c)) for d, S, c in shapes], split=args.split)
    return 0


if __name__ == "__main__":
    sys.exit(main())

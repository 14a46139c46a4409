"""Experiment: the Gluon forward's three schedules, timed side by side (H200).

    PYTHONPATH=src python3 benchmarks/experiments/fwd_schedule.py [--shapes "128,2048,1;..."]

``ops/forward_sm90.attention_forward_ws`` runs one program per work item (the library's
choice at d256 without causal), a static persistent loop (one program per SM taking
items pid, pid + grid, ...), or the dynamic schedule (one program per SM claiming items
from an atomic counter; the library's default elsewhere since H200 run 44, which this
script measured). Each is checked against float32 SDPA
(out and LSE) before it is timed; cuDNN's forward is timed on the same inputs.
BENCHMARKS.md shapes: batch x seqlen = 16k tokens, hidden 2048.
"""

from __future__ import annotations

import argparse

SCHEDULES = {"per-item": dict(persistent=False), "static": dict(persistent=True), "dynamic": dict(dynamic=True)}


def run(shapes, dtype_name: str = "bf16") -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashtile.backends.sm90.forward import attention_forward_ws

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    for D, S, causal in shapes:
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, S, device="cuda")
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        # Reference on the first two heads of batch 0 (every schedule covers them like any other).
        q0, k0, v0 = (t[:1, :2].float() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q0, k0, v0, is_causal=causal)
        s = q0 @ k0.transpose(-1, -2) * D ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        ref_lse = torch.logsumexp(s, -1)
        del s
        row = {}
        for name, kw in SCHEDULES.items():
            def call(kw=kw):
                attention_forward_ws(q, k, v, out, lse, scale=D ** -0.5, diag_offset=0, causal=causal, **kw)

            try:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                if out.isnan().any() or lse.isnan().any():
                    print(f"d{D} S{S} causal={int(causal)} {name}: WRONG, outputs left unwritten", flush=True)
                    continue
                err = (out[:1, :2].float() - ref).abs().max().item()
                lse_err = (lse[:1, :2] - ref_lse).abs().max().item()
                if not (err < 3e-2 and lse_err < 1e-3):
                    print(f"d{D} S{S} causal={int(causal)} {name}: WRONG out err {err:.2e} lse err {lse_err:.2e}",
                          flush=True)
                    continue
                row[name] = flops / do_bench(call, warmup=25, rep=100) * 1e-9
            except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
                print(f"d{D} S{S} causal={int(causal)} {name} failed: {type(exc).__name__}: {str(exc)[:200]}",
                      flush=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn"] = flops / do_bench(
                lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                warmup=25, rep=100) * 1e-9
        print(f"d{D} S{S} causal={int(causal)}: " + "  ".join(f"{k_} {v_:6.1f}" for k_, v_ in row.items())
              + " TF/s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=";".join(f"{d},{s},1" for d in (64, 128, 256) for s in (1024, 2048, 4096, 16384))
                   + ";64,2048,0;128,2048,0", help="headdim,seqlen,causal;...")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = p.parse_args(argv)
    run([(int(d), int(s), bool(int(c))) for d, s, c in (x.split(",") for x in args.shapes.split(";"))], args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

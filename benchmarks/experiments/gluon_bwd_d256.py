"""Experiment: the Gluon backward at head dim 256, measured before it was wired in.

At head dim 256 the backward ran the Triton kernels (0.45-0.53x cuDNN on the H200, runs
41-42): the Gluon dK/dV kernel cannot hold two 64 x 256 float32 accumulators per
warpgroup. The Gluon dQ kernel can (one accumulator, 32-key tiles: 2 or 3 ring slots fit
shared memory), and the dK/dV side can go to Gluon too when dK and dV come from separate
programs (``backward_sm90._dv_kernel``: two warpgroups of 64 keys, S then dV += P^T dO;
``_dk_kernel``: one warpgroup of 64 keys, S and dP then dK += dS^T Q). Run 45 measured the
parts; the all-Gluon backward won (1.6-1.8x the Triton kernels) and is now the library's
d256 backward (``backward_sm90.attention_backward_ws``).

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_d256.py            # H200

For each shape: the Triton backward (``FLASHTILE_WS=0``), its dK/dV kernel alone and its
dQ kernel alone (the other launcher stubbed out), the Gluon dQ kernel for each (key tile,
ring slots), the Gluon dV and dK kernels alone, cuDNN, the projected hybrid (Triton dK/dV
+ the best Gluon dQ) and the all-Gluon backward (dV + dK + dQ). TF/s use the whole
backward's FLOPs (2.5x the forward's) so the columns add as times. All of it is checked
against fp32 autograd first, on odd shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from flashtile.ops.backward_sm90 import attention_backward_ws

DQ_VARIANTS = ((32, 2), (32, 3))  # (keys per tile, ring slots); 64-key tiles need 262 KB


@contextlib.contextmanager
def _stubbed(module, name):
    """``module.name`` replaced by a no-op launcher for the duration."""
    saved = getattr(module, name)
    setattr(module, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(module, name, saved)


def run(shapes) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashtile.ops import backward as tb
    from gluon_bwd import ref_grads

    os.environ["FLASHTILE_WS"] = "0"  # tb.attention_backward: the Triton kernels (Gluon is called directly)

    def gluon_dq(q, k, v, dout, lse, delta, dq, causal, diag, block_n, num_buf):
        attention_backward_ws(q, k, v, dout, lse, delta, dq, None, None, scale=q.shape[-1] ** -0.5,
                              diag_offset=diag, causal=causal, kernels=("dq",), dq_block_n=block_n,
                              dq_num_buf=num_buf)

    # Correctness of the Gluon dQ at d256 against fp32 autograd (odd lengths, GQA, causal
    # rows that see no key).
    for B, H, Hk, Sq, Sk, causal in ((2, 4, 2, 333, 517, True), (1, 4, 4, 1000, 1000, False),
                                     (2, 6, 1, 300, 129, False), (1, 2, 2, 700, 200, True), (1, 2, 2, 1, 300, False)):
        g = torch.Generator(device="cuda").manual_seed(0)
        D = 256
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        diag = Sk - Sq
        out, lse, dq_ref, dk_ref, dv_ref = ref_grads(q, k, v, dout, causal, diag)
        lse = lse.detach().contiguous()
        delta = (out.detach() * dout.float()).sum(-1).contiguous()
        name = f"B{B} H{H}/{Hk} Sq{Sq} Sk{Sk} causal={int(causal)}"
        for block_n, num_buf in DQ_VARIANTS:
            dq = torch.full_like(q, float("nan"))
            gluon_dq(q, k, v, dout, lse, delta, dq, causal, diag, block_n, num_buf)
            err = (dq.float() - dq_ref).abs().max().item()
            print(f"{name} dq({block_n},{num_buf}): max err {err:.2e} / |ref| {dq_ref.abs().max().item():.1e}",
                  flush=True)
        try:
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            attention_backward_ws(q, k, v, dout, lse, delta, *grads, scale=D ** -0.5, diag_offset=diag,
                                  causal=causal)
            torch.cuda.synchronize()
            errs = "  ".join(f"{n} {(g_.float() - r).abs().max().item():.2e}/{r.abs().max().item():.1e}"
                             for n, g_, r in zip(("dq", "dk", "dv"), grads, (dq_ref, dk_ref, dv_ref)))
            print(f"{name} split (dV, dK, dQ kernels): max err/|ref| {errs}", flush=True)
        except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
            print(f"{name} split failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    for S, causal in shapes:
        B, H, D = 16384 // S, 2048 // 256, 256
        q, k, v, out, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(B, H, S, device="cuda").abs() + 5
        delta = torch.randn(B, H, S, device="cuda")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd_flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        config = tb_config(q, causal)

        def triton_bwd():
            tb.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, scale=D ** -0.5, diag_offset=0,
                                  window_left=-1, window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None,
                                  attn_mask=None, config=config)

        row = {"triton": bwd_flops / do_bench(triton_bwd, warmup=25, rep=100) * 1e-9}
        ms = {}
        for part, other in (("dkdv", "_launch_dq"), ("dq", "_launch_dkdv")):
            with _stubbed(tb, other):
                ms[part] = do_bench(triton_bwd, warmup=25, rep=100)
            row[f"  triton {part}"] = bwd_flops / ms[part] * 1e-9
        for block_n, num_buf in DQ_VARIANTS:
            ms_g = do_bench(lambda: gluon_dq(q, k, v, dout, lse, delta, dq, causal, 0, block_n, num_buf),
                            warmup=25, rep=100)
            ms[(block_n, num_buf)] = ms_g
            row[f"gluon dq{block_n},{num_buf}"] = bwd_flops / ms_g * 1e-9
        best = min(ms[v_] for v_ in DQ_VARIANTS)
        row["hybrid (projected)"] = bwd_flops / (ms["dkdv"] + best) * 1e-9

        def split(kernels=("dkdv", "dq")):
            attention_backward_ws(q, k, v, dout, lse, delta, dq, dk, dv, scale=D ** -0.5, diag_offset=0,
                                  causal=causal, kernels=kernels)

        try:
            for part in ("dv", "dk"):
                row[f"gluon {part}"] = bwd_flops / do_bench(lambda: split((part,)), warmup=25, rep=100) * 1e-9
            row["gluon all"] = bwd_flops / do_bench(split, warmup=25, rep=100) * 1e-9
        except Exception as exc:  # noqa: BLE001
            print(f"d256 S{S} split failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                row["cudnn"] = bwd_flops / do_bench(
                    lambda: torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True), warmup=25, rep=100) * 1e-9
        except Exception as exc:  # noqa: BLE001
            print(f"d256 S{S} cudnn failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        print(f"d256 S{S} causal={int(causal)}: " + "  ".join(f"{k_} {v_:6.1f}" for k_, v_ in row.items())
              + " TF/s", flush=True)


def tb_config(q, causal: bool):
    """The backward config the library's table picks for this call."""
    from flashtile.ops.configs import cuda_capability, default_bwd_config, device_index

    return default_bwd_config(cuda_capability(device_index(q.device)), q.shape[-1],
                              str(q.dtype).replace("torch.", ""), True, tile_masks=causal)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2048,0;2048,1;4096,0;4096,1;16384,0;16384,1", help="seqlen,causal;...")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gluon_bwd.ref_grads
    run([(int(s), bool(int(c))) for s, c in (x.split(",") for x in args.shapes.split(";"))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

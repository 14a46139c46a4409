"""``flashtile check``: does flashtile work on this machine?

Runs a small matrix of every public API family against a float64 reference under the
accuracy rule (``flashtile.testing``: at most 2x, for gradients 3x, the error of plain
PyTorch in the same dtype). On a GPU it runs the kernels at fp16 and bf16. On CPU it runs
the torch twin at float32. It prints one line per case with the worst error/tolerance
ratio (below 1 passes), the machine and versions, and the kernels the main case took.
The exit status is 1 when a case fails::

    flashtile check                 # the GPU if there is one, else the CPU
    flashtile check --device cpu
"""

from __future__ import annotations

import math
import platform
from typing import Callable


def _verdicts(pairs, factor_of) -> tuple[bool, float, str]:
    from flashtile.testing import compare

    parts, ok, worst = [], True, 0.0
    for name, out, ref, base in pairs:
        v = compare(name, out, ref, base, factor_of(name))
        ok &= v.ok
        ratio = v.err / v.tol if v.tol > 0 else (0.0 if v.err == 0 else math.inf)
        worst = max(worst, ratio)
        parts.append(f"{name} {ratio:.2f}" + ("" if v.ok else f" FAIL({v.reason or 'err > tol'})"))
    return ok, worst, "  ".join(parts)


def _factor(name: str) -> float:
    from flashtile.testing import FORWARD_FACTOR, GRAD_FACTOR

    return GRAD_FACTOR if name.startswith("d") else FORWARD_FACTOR


def _with_grads(fn, inputs, dout):
    """fn(*inputs) and the gradients of <fn(*inputs), dout> wrt inputs."""
    import torch

    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


def _plain(q, k, v, dtype, **kw):
    """plain_attention in ``dtype`` on flash-attn layout tensors (B, S, H, D)."""
    from flashtile.testing import plain_attention

    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return t(plain_attention(t(q.to(dtype)), t(k.to(dtype)), t(v.to(dtype)), dtype=dtype, **kw)[0])


def _reference(q, k, v, dout, dtype, **kw):
    """``_plain`` and its gradients of <out, dout> wrt q, k, v."""
    return _with_grads(lambda q, k, v: _plain(q, k, v, dtype, **kw), [x.to(dtype) for x in (q, k, v)],
                       dout.to(dtype))


def _out_and_grads(out, grads, ref, ref_grads, base, base_grads):
    """The comparisons of a differentiable case: out, then dq, dk, dv."""
    return [("out", out, ref, base)] + list(zip(("dq", "dk", "dv"), grads, ref_grads, base_grads))


def _flash_case(device, dtype, *, causal=False, window=(-1, -1), softcap=0.0, alibi=False, heads=(4, 2), d=64):
    import torch

    import flashtile

    g = torch.Generator(device="cpu").manual_seed(0)
    b, s = 2, 200
    h, hk = heads
    q = torch.randn(b, s, h, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, s, hk, d, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(b, s, h, d, generator=g).to(device, dtype)
    slopes = (torch.rand(h, generator=g) * 0.3).to(device) if alibi else None
    left, right = window
    if causal:
        right = 0
    kw = dict(scale=d ** -0.5, diag_offset=0, window_left=left, window_right=right, softcap=softcap,
              alibi_slopes=None if slopes is None else slopes[None].expand(b, h))
    out, grads = _with_grads(lambda q, k, v: flashtile.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes), [q, k, v], dout)
    ref, ref_g = _reference(q, k, v, dout, torch.float64, **kw)
    base, base_g = _reference(q, k, v, dout, dtype, **kw)
    return _verdicts(_out_and_grads(out, grads, ref, ref_g, base, base_g), _factor)


def _varlen_case(device, dtype):
    import torch

    import flashtile

    g = torch.Generator(device="cpu").manual_seed(1)
    lens = [100, 0, 257]  # a document of length 0 in the middle
    total, h, hk, d = sum(lens), 4, 2, 64
    q = torch.randn(total, h, d, generator=g).to(device, dtype)
    k, v = (torch.randn(total, hk, d, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(total, h, d, generator=g).to(device, dtype)
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device=device)
    out, grads = _with_grads(lambda q, k, v: flashtile.flash_attn_varlen_func(
        q, k, v, cu, cu, max(lens), max(lens), causal=True), [q, k, v], dout)

    def per_doc(dt):
        outs, gq, gk, gv = [], [], [], []
        for a, n in zip([0, 100, 100], lens):
            if n == 0:
                continue
            sl = slice(a, a + n)
            o, (dq, dk, dv) = _reference(q[None, sl], k[None, sl], v[None, sl], dout[None, sl], dt,
                                         scale=d ** -0.5, diag_offset=0, window_right=0)
            outs.append(o[0]), gq.append(dq[0]), gk.append(dk[0]), gv.append(dv[0])
        return torch.cat(outs), [torch.cat(x) for x in (gq, gk, gv)]

    ref, ref_g = per_doc(torch.float64)
    base, base_g = per_doc(dtype)
    return _verdicts(_out_and_grads(out, grads, ref, ref_g, base, base_g), _factor)


def _sdpa_case(device, dtype):
    import torch

    import flashtile
    from flashtile.testing import plain_attention

    g = torch.Generator(device="cpu").manual_seed(2)
    b, h, s, d = 2, 4, 150, 64
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).to(device, dtype) for _ in range(4))
    mask = (torch.rand(b, 1, s, s, generator=g) > 0.3).to(device) | torch.eye(s, dtype=torch.bool, device=device)
    out, grads = _with_grads(lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                             [q, k, v], dout)

    def ref_in(dt):
        return _with_grads(lambda q, k, v: plain_attention(q, k, v, scale=d ** -0.5, attn_mask=mask, dtype=dt)[0],
                           [x.to(dt) for x in (q, k, v)], dout.to(dt))

    ref, ref_g = ref_in(torch.float64)
    base, base_g = ref_in(dtype)
    return _verdicts(_out_and_grads(out, grads, ref, ref_g, base, base_g), _factor)


def _kvcache_case(device, dtype, *, page=0):
    """Append one token per sequence into a row or paged cache, then decode (causal)."""
    import torch

    import flashtile

    g = torch.Generator(device="cpu").manual_seed(3)
    b, cap, h, hk, d = 3, 320, 8, 2, 64
    seqlens = [0, 120, 300]
    q = torch.randn(b, 1, h, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, 1, hk, d, generator=g).to(device, dtype) for _ in range(2))
    rows_k, rows_v = (torch.randn(b, cap, hk, d, generator=g).to(device, dtype) for _ in range(2))
    kw = {}
    if page:
        per = cap // page
        order = torch.randperm(b * per, generator=g)
        table = order.reshape(b, per).to(device, torch.int32)
        kc = torch.empty(b * per, page, hk, d, device=device, dtype=dtype)
        vc = torch.empty_like(kc)
        kc[order] = rows_k.reshape(b * per, page, hk, d)  # page table[b, p] holds rows b, p*page..
        vc[order] = rows_v.reshape(b * per, page, hk, d)
        kw["block_table"] = table
    else:
        kc, vc = rows_k.clone(), rows_v.clone()
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True, **kw)

    def ref_in(dt):
        outs = []
        for i, n in enumerate(seqlens):
            keys = torch.cat([rows_k[i, :n], k[i]])[None]
            vals = torch.cat([rows_v[i, :n], v[i]])[None]
            outs.append(_plain(q[i:i + 1], keys, vals, dt, scale=d ** -0.5, diag_offset=n, window_right=0))
        return torch.cat(outs)

    ok, worst, detail = _verdicts([("out", out, ref_in(torch.float64), ref_in(dtype))], _factor)
    appended = kc[table[torch.arange(b), torch.tensor(seqlens) // page], torch.tensor(seqlens) % page] if page else \
        kc[torch.arange(b), torch.tensor(seqlens)]
    if not torch.equal(appended, k[:, 0]):
        ok, detail = False, detail + "  cache FAIL(the new keys are not where they belong)"
    return ok, worst, detail


def _flex_case(device, dtype):
    """flex_attention with a translated score_mod (a relative-position table) and a document
    mask built by torch's create_block_mask: the flex kernels on a GPU, the twin on CPU."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import flashtile
    from flashtile.backends.twin.flex import forward as twin_forward
    from flashtile.problem.blockmask import sparsity

    g = torch.Generator(device="cpu").manual_seed(4)
    b, h, hk, s, d = 2, 4, 2, 200, 64
    q = torch.randn(b, h, s, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, hk, s, d, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(b, h, s, d, generator=g).to(device, dtype)
    table = (torch.randn(h, 2 * s - 1, generator=g) * 0.5).to(device)
    docs = (torch.arange(s, device=device) // 70)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + (s - 1)]

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, None, None, s, s, device=device, BLOCK_SIZE=64)
    out, grads = _with_grads(lambda q, k, v: flashtile.flex_attention(q, k, v, score_mod=score_mod,
                                                                      block_mask=block_mask, enable_gqa=True),
                             [q, k, v], dout)
    sp = sparsity(block_mask, b, h, s, s, device)

    def plain(q, k, v):
        """Plain PyTorch in the input dtype (the rule's base): products and weights in it."""
        kk, vv = (x.repeat_interleave(h // hk, 1) for x in (k, v))
        i = torch.arange(s, device=device)
        scores = score_mod((q @ kk.transpose(-1, -2)) * d ** -0.5, None, torch.arange(h, device=device).view(
            1, -1, 1, 1), i.view(1, 1, -1, 1), i.view(1, 1, 1, -1)).to(q.dtype)
        keep = mask_mod(None, None, i.view(-1, 1), i.view(1, -1))
        p = torch.softmax(scores.float().masked_fill(~keep, float("-inf")), -1).to(q.dtype)
        return p @ vv

    ref, ref_g = _with_grads(lambda q, k, v: twin_forward(q, k, v, score_mod, sp, d ** -0.5)[0],
                             [x.to(torch.float64) for x in (q, k, v)], dout.to(torch.float64))
    base, base_g = _with_grads(plain, [q, k, v], dout)
    return _verdicts(_out_and_grads(out, grads, ref, ref_g, base, base_g), _factor)


def _cases(device, dtype) -> list[tuple[str, Callable]]:
    return [
        ("flash_attn_func", lambda: _flash_case(device, dtype)),
        ("flash_attn_func causal", lambda: _flash_case(device, dtype, causal=True)),
        ("flash_attn_func window+softcap", lambda: _flash_case(device, dtype, window=(48, 16), softcap=20.0)),
        ("flash_attn_func alibi, MQA", lambda: _flash_case(device, dtype, causal=True, alibi=True, heads=(4, 1))),
        ("flash_attn_func d128", lambda: _flash_case(device, dtype, causal=True, d=128)),
        ("flash_attn_varlen_func", lambda: _varlen_case(device, dtype)),
        ("scaled_dot_product_attention mask", lambda: _sdpa_case(device, dtype)),
        ("flash_attn_with_kvcache rows", lambda: _kvcache_case(device, dtype)),
        ("flash_attn_with_kvcache page 16", lambda: _kvcache_case(device, dtype, page=16)),
        ("flex_attention relative bias, documents", lambda: _flex_case(device, dtype)),
    ]


def environment(device: str) -> str:
    import torch

    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    try:
        import triton

        lines[0] += f", triton {triton.__version__}"
    except ModuleNotFoundError:
        lines[0] += ", no triton"
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        lines.append(f"GPU {p.name} (sm{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    else:
        lines.append("CPU tensors: the torch twin (no GPU used)")
    return "\n".join(lines)


def run_check(device: str = "auto", dtypes=None, out=print) -> int:
    """Run the matrix, print it (``out``), return 0 when every case passes, else 1."""
    import torch

    from flashtile.tools.explain import explain

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        out("flashtile check: --device cuda, but torch sees no CUDA GPU")
        return 2
    if dtypes is None:
        dtypes = [torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32]
    out(environment(device))
    cap = tuple(torch.cuda.get_device_capability(0)) if device == "cuda" else (0, 0)
    plan = explain(200, head_dim=64, dtype="bf16" if device == "cuda" else "fp32", causal=True, device=device,
                   capability=cap if device == "cuda" else (9, 0))
    out(f"kernels of flash_attn_func (d64, causal): {plan.backend}\n{plan}")
    out("err/tol per output (passes below 1; the rule of flashtile.testing)")
    failed = 0
    for dtype in dtypes:
        for name, fn in _cases(device, dtype):
            label = f"{name} [{str(dtype).replace('torch.', '')}]"
            try:
                ok, worst, detail = fn()
            except Exception as err:  # report and go on: the point is the whole picture
                ok, worst, detail = False, math.inf, f"{type(err).__name__}: {err}"
            failed += not ok
            out(f"{'ok  ' if ok else 'FAIL'}  {label:46s} {detail}")
    total = len(dtypes) * len(_cases(device, dtypes[0]))
    out(f"{total - failed}/{total} cases pass" + ("" if not failed else f", {failed} fail"))
    return 1 if failed else 0

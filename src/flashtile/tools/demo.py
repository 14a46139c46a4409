"""``flashtile demo``: the lesson's demonstrations, checked and printed for a person.

Five sections, each a claim about FlashAttention-2's tile algebra and the numbers that
back it:

1. the tiled forward equals the textbook formula (float64, to ~machine precision);
2. the HBM traffic model: the naive N x N round trips grow as N^2, the tiles' as N;
3. logits shifted by +500: the no-max softmax overflows in float32, the online softmax
   does not;
4. the causal invariant: row i never reads keys/values after its diagonal;
5. the backward pass: tiled gradients equal the textbook ones and finite differences.

NumPy only (plus :mod:`flashtile.traffic`); runs in a few seconds on a laptop CPU.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from typing import Callable, TextIO

import numpy as np

from flashtile.reference import (flash_attention_backward, flash_attention_forward, naive_attention,
                                 naive_attention_backward, unstable_attention)

SECTION_TITLES: tuple[str, ...] = (
    "1. Tiled vs naive attention (float64)",
    "2. HBM traffic: naive N x N round trips vs tiles",
    "3. Extreme logits: every score shifted by +500",
    "4. Causal invariant: row i never reads keys after its diagonal",
    "5. Backward pass: tiled gradients vs naive and finite differences",
)

# float64 tile algebra differs from the one-shot formula only by re-association.
EXACT_TOL = 1e-12
# float32 scores near 500 carry an absolute rounding error of ~500 * 2^-24 = 3e-5 each,
# so the float32 output can be ~1e-5 away from the float64 one; 1e-4 leaves room.
SHIFTED_F32_TOL = 1e-4
# Central differences with step 1e-6 in float64: truncation ~h^2, rounding ~1e-16/h.
FD_STEP = 1e-6
FD_TOL = 1e-6
LOGIT_SHIFT = 500.0
TRAFFIC_SEQ_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Checks:
    """Prints one line per check and remembers which ones failed."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.failed: list[str] = []
        self.count = 0

    def record(self, name: str, ok: bool, detail: str) -> bool:
        self.count += 1
        if not ok:
            self.failed.append(name)
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}", file=self.file)
        return ok

    def at_most(self, name: str, value: float, tol: float) -> bool:
        # `value <= tol` is False for NaN, so a NaN result fails as it should.
        return self.record(name, bool(value <= tol), f"{value:.3e} (<= {tol:.0e})")


def _heading(title: str, file: TextIO) -> None:
    print(f"\n{title}\n{'=' * len(title)}", file=file)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _qkv(rng: np.random.Generator, lead: tuple[int, ...], Sq: int, Sk: int, d: int):
    return (
        rng.standard_normal(lead + (Sq, d)),
        rng.standard_normal(lead + (Sk, d)),
        rng.standard_normal(lead + (Sk, d)),
    )


def shift_logits(Q: np.ndarray, K: np.ndarray, shift: float, scale: float | None = None):
    """Return (Q', K') with Q'_i . K'_j = scale * Q_i . K_j + shift for every pair.

    One extra feature does it: Q' = [scale * Q, 1] and K' = [K, shift], to be used with
    ``scale=1.0``. Softmax is invariant to adding a constant to a row, so attention on
    (Q', K', V) must equal attention on (Q, K, V): only the arithmetic gets harder.
    """
    d = Q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ones = np.ones(Q.shape[:-1] + (1,), dtype=Q.dtype)
    shifts = np.full(K.shape[:-1] + (1,), shift, dtype=K.dtype)
    return np.concatenate([scale * Q, ones], axis=-1), np.concatenate([K, shifts], axis=-1)


def _section_exactness(checks: _Checks, rng: np.random.Generator) -> None:
    file = checks.file
    print("The tiled forward (Q tiles outer, K/V tiles inner, online softmax) against the", file=file)
    print("textbook softmax(QK^T/sqrt(d))V, on shapes whose tiles do not divide N and with", file=file)
    print("Sq != Sk (causal is aligned bottom-right: query i sees keys j <= i + Sk - Sq).", file=file)
    cases = [
        # (leading dims, Sq, Sk, d, Br, Bc)
        ((), 256, 256, 64, 64, 64),
        ((), 200, 200, 64, 64, 48),
        ((), 77, 300, 32, 16, 64),
        ((), 300, 77, 32, 64, 16),
        ((2, 4), 129, 129, 16, 32, 32),
        ((), 1024, 1024, 64, 64, 64),
    ]
    for lead, Sq, Sk, d, Br, Bc in cases:
        Q, K, V = _qkv(rng, lead, Sq, Sk, d)
        for causal in (False, True):
            diff = _max_abs_diff(
                flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=causal),
                naive_attention(Q, K, V, causal=causal),
            )
            batch = "x".join(map(str, lead)) or "-"
            label = (f"{'causal' if causal else 'full':6s} batch={batch:<4s} Sq={Sq:<5d}Sk={Sk:<5d}"
                     f"d={d:<3d}Br={Br:<3d}Bc={Bc:<3d}")
            checks.at_most(label, diff, EXACT_TOL)


def _section_traffic(checks: _Checks) -> None:
    file = checks.file
    print("Naive attention writes S = QK^T and P = softmax(S) to HBM and reads them back: four", file=file)
    print("N x N arrays, 4 N^2 element touches per head, so its bytes grow as N^2. The tiles keep", file=file)
    print("S and P in SRAM: zero N x N touches, and the compulsory bytes (Q, K, V, O, LSE moved", file=file)
    print("once) grow as N.", file=file)
    print("Re-reading K and V for every Q tile adds 2 N^2 d / Br elements: quadratic too (with", file=file)
    print("d = Br, half the naive bytes: the 2.0x column), but it is traffic a GPU's L2 cache can", file=file)
    print("absorb, which this pessimistic model does not credit. d=64, float32, Br=Bc=64:", file=file)
    try:
        from flashtile.traffic import memory_work, print_traffic_table
    except ImportError as exc:
        checks.record("traffic model importable", False, f"{type(exc).__name__}: {exc}")
        return
    rows = print_traffic_table(
        seq_lengths=TRAFFIC_SEQ_LENGTHS, d=64, dtype_bytes=4, Br=64, Bc=64, causal=False, file=file
    )
    ns = np.array([row["N"] for row in rows], dtype=np.float64)
    per_n2 = np.array([row["naive_nxn_elements"] for row in rows]) / ns**2
    per_n = np.array([row["flash_compulsory_bytes"] for row in rows]) / ns
    checks.record(
        "naive N x N elements grow as N^2",
        len(rows) == len(TRAFFIC_SEQ_LENGTHS) and bool(np.all(per_n2 == per_n2[0])),
        f"elements / N^2 = {per_n2[0]:g} for every N",
    )
    checks.record(
        "flash compulsory bytes grow as N",
        bool(np.all(per_n == per_n[0])),
        f"bytes / N = {per_n[0]:g} for every N",
    )
    touches = {memory_work(int(n), 64).flash.nxn_touches for n in TRAFFIC_SEQ_LENGTHS}
    checks.record("flash N x N touches", touches == {0}, f"{sorted(touches)} for every N")


def _section_extreme(checks: _Checks, rng: np.random.Generator) -> None:
    file = checks.file
    print(f"Append one feature: Q' = [Q/sqrt(d), 1], K' = [K, {LOGIT_SHIFT:g}], scale = 1. Then every score", file=file)
    print(f"is q.k/sqrt(d) + {LOGIT_SHIFT:g} and softmax (shift-invariant) gives the same attention. In float32", file=file)
    print("exp overflows above ~88.7: exp(S)/sum(exp(S)) becomes inf/inf = NaN. The online softmax", file=file)
    print("only ever takes exp(s - running max) <= 1.", file=file)
    N, d = 256, 64
    Q, K, V = _qkv(rng, (), N, N, d)
    Qs, Ks = shift_logits(Q, K, LOGIT_SHIFT)
    Qs32, Ks32, V32 = Qs.astype(np.float32), Ks.astype(np.float32), V.astype(np.float32)
    lo, hi = [f(Qs32.astype(np.float64) @ Ks32.astype(np.float64).T) for f in (np.min, np.max)]
    print(f"  scores of the shifted inputs span [{lo:.1f}, {hi:.1f}]", file=file)

    unstable = unstable_attention(Qs32, Ks32, V32, scale=1.0)
    n_bad = int(np.count_nonzero(~np.isfinite(unstable)))
    checks.record(
        "unstable float32 softmax overflows",
        n_bad > 0,
        f"{n_bad} of {unstable.size} outputs are NaN/inf",
    )
    for causal in (False, True):
        mask = "causal" if causal else "full"
        tiled = flash_attention_forward(Qs32, Ks32, V32, causal=causal, scale=1.0)
        # The reference sees the same float32 inputs, computed stably in float64.
        ref = naive_attention(*(x.astype(np.float64) for x in (Qs32, Ks32, V32)), causal=causal, scale=1.0)
        finite = bool(np.all(np.isfinite(tiled)))
        checks.record(f"tiled float32 finite ({mask})", finite and tiled.dtype == np.float32, f"dtype {tiled.dtype}")
        checks.at_most(f"tiled float32 vs float64 stable reference ({mask})", _max_abs_diff(tiled, ref), SHIFTED_F32_TOL)
    # And the shift really changed nothing: same answer as the unshifted problem.
    checks.at_most(
        "float64: attention(Q', K') == attention(Q, K)",
        _max_abs_diff(naive_attention(Qs, Ks, V, scale=1.0), naive_attention(Q, K, V)),
        EXACT_TOL,
    )


def _section_causal(checks: _Checks, rng: np.random.Generator) -> None:
    file = checks.file
    print("Re-draw every key and value that row i must not see (j > i + Sk - Sq) and rerun the", file=file)
    print("tiled forward: rows 0..i must come out bit for bit the same. As a control, changing", file=file)
    print("value j = i + Sk - Sq (on the diagonal, which row i does see) must change row i.", file=file)
    Br, Bc = 16, 16
    for Sq, Sk in ((64, 64), (48, 80)):
        offset = Sk - Sq
        Q, K, V = _qkv(rng, (), Sq, Sk, 32)
        base = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=True)
        for i in (0, 17, Sq // 2 + 3, Sq - 2):
            last = i + offset  # last key row i may see
            K2, V2 = K.copy(), V.copy()
            K2[last + 1 :] = rng.standard_normal(K2[last + 1 :].shape)
            V2[last + 1 :] = rng.standard_normal(V2[last + 1 :].shape)
            out = flash_attention_forward(Q, K2, V2, Br=Br, Bc=Bc, causal=True)
            same = np.array_equal(out[: i + 1], base[: i + 1])
            later_changed = not np.array_equal(out[i + 1 :], base[i + 1 :])
            # A value, not a key: row 0 of a square mask sees one key, whose softmax weight
            # is 1 whatever the key is.
            V3 = V.copy()
            V3[last] += 1.0
            control = not np.array_equal(flash_attention_forward(Q, K, V3, Br=Br, Bc=Bc, causal=True)[i], base[i])
            checks.record(
                f"Sq={Sq} Sk={Sk} row {i:2d}",
                same and later_changed and control,
                f"rows 0..{i} bitwise equal: {same}; later rows changed: {later_changed}; "
                f"value {last} matters: {control}",
            )


def _finite_difference_errors(
    loss: Callable[[np.ndarray, np.ndarray, np.ndarray], float],
    inputs: list[np.ndarray],
    grads: tuple[np.ndarray, ...],
    rng: np.random.Generator,
    per_input: int = 3,
) -> float:
    """Largest |central difference - analytic| / max(1, |analytic|) over random coordinates."""
    worst = 0.0
    for x, g in zip(inputs, grads):
        for _ in range(per_input):
            idx = tuple(int(rng.integers(n)) for n in x.shape)
            saved = x[idx]
            x[idx] = saved + FD_STEP
            up = loss(*inputs)
            x[idx] = saved - FD_STEP
            down = loss(*inputs)
            x[idx] = saved
            fd = (up - down) / (2 * FD_STEP)
            worst = max(worst, abs(fd - g[idx]) / max(1.0, abs(g[idx])))
    return worst


def _section_backward(checks: _Checks, rng: np.random.Generator) -> None:
    file = checks.file
    print("The tiled backward recomputes P tile by tile from the saved row log-sum-exp instead", file=file)
    print("of storing it. Checked against the textbook gradients and against central finite", file=file)
    print("differences of the scalar loss L = sum(O * dO), whose gradient is exactly (dQ, dK, dV).", file=file)
    Br, Bc = 16, 8
    for Sq, Sk, causal in ((37, 53, False), (37, 53, True), (53, 37, True)):
        Q, K, V = _qkv(rng, (), Sq, Sk, 16)
        dO = rng.standard_normal((Sq, 16))
        O, lse = flash_attention_forward(Q, K, V, Br=Br, Bc=Bc, causal=causal, return_lse=True)
        grads = flash_attention_backward(Q, K, V, O, dO, lse, Br=Br, Bc=Bc, causal=causal)
        ref = naive_attention_backward(Q, K, V, dO, causal=causal)
        label = f"{'causal' if causal else 'full':6s} Sq={Sq} Sk={Sk}"
        diff = max(_max_abs_diff(g, r) for g, r in zip(grads, ref))
        checks.at_most(f"{label} max|d(Q,K,V) - naive|", diff, EXACT_TOL)

        def loss(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> float:
            return float(np.sum(flash_attention_forward(q, k, v, Br=Br, Bc=Bc, causal=causal) * dO))

        fd_err = _finite_difference_errors(loss, [Q, K, V], grads, rng)
        checks.at_most(f"{label} finite differences (rel. error)", fd_err, FD_TOL)


def run_demo(file: TextIO | None = None) -> int:
    """Run the five demonstrations, printing to ``file`` (default stdout).

    Returns:
        0 if every check passed, 1 otherwise (the failed checks are listed at the end).
    """
    file = sys.stdout if file is None else file
    rng = np.random.default_rng(2023)  # fixed: the demo prints the same numbers every run
    checks = _Checks(file)
    start = time.perf_counter()
    print("flashtile demo: FlashAttention-2's tile algebra in NumPy", file=file)
    sections = (
        lambda: _section_exactness(checks, rng),
        lambda: _section_traffic(checks),
        lambda: _section_extreme(checks, rng),
        lambda: _section_causal(checks, rng),
        lambda: _section_backward(checks, rng),
    )
    for title, section in zip(SECTION_TITLES, sections):
        _heading(title, file)
        try:
            section()
        except Exception as exc:  # report and go on: the other sections still say something
            traceback.print_exc(file=file)
            checks.record(f"section {title.split('.')[0]} ran", False, f"{type(exc).__name__}: {exc}")
    elapsed = time.perf_counter() - start
    print("", file=file)
    if checks.failed:
        print(f"FAILED {len(checks.failed)} of {checks.count} checks ({elapsed:.1f} s):", file=file)
        for name in checks.failed:
            print(f"  - {name}", file=file)
        return 1
    print(f"All {checks.count} checks passed ({elapsed:.1f} s).", file=file)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_demo())

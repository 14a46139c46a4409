"""The traffic model against the GPU's own byte counters: ``flashtile traffic --measure``.

`flashtile.traffic` predicts the HBM bytes of naive and tiled attention; this module reads
what the hardware moved. It runs, at a few sequence lengths N and head dims d (batch 1,
``heads`` heads, bf16, no mask):

- **naive** attention as three PyTorch kernels (S = Q K^T, P = softmax(S), O = P V; the
  backward through autograd, which keeps P);
- **flashtile**'s forward (`flash_attn_func`) and its backward (`torch.autograd.grad`),

each once under Nsight Compute (``ncu``), which reports every kernel's
``dram__bytes_read.sum`` and ``dram__bytes_write.sum``. Each measured pass is printed next
to the model's two numbers for it:

- ``compulsory``: `traffic.min_hbm_bytes`, every tensor moved once (the floor);
- ``no cache``: every re-read of the algorithm served by HBM (`traffic.memory_work` with
  ``sram_kv_reuse="hbm"`` and the kernel's real tile sizes; for flashtile's backward,
  `split_backward_bytes`: its dK/dV kernel re-reads Q, dO, LSE and D per K/V tile, its dQ
  kernel K and V per Q tile).

For flashtile the share of the re-read traffic that the L2 absorbed is
(no cache - measured) / (no cache - compulsory): 1.0 when HBM saw only the compulsory
bytes, 0.0 when every re-read reached it.

How it is measured. The parent process starts ``ncu --profile-from-start off`` on a worker
(``python -m flashtile.traffic_measure --worker``) that sets up each case, runs it once to
compile and warm up, then runs it again between ``cudaProfilerStart`` and
``cudaProfilerStop`` behind a one-thread marker kernel (`MARKER`), so the kernels of a
case are the rows between two markers of ncu's CSV. ncu's default cache control flushes
the L2 before every kernel, so each kernel starts cold: a kernel's re-reads can hit lines
it brought in itself, not lines an earlier kernel left. Dirty lines still in the L2 when a
kernel ends are written back outside it; a kernel's counted writes can fall short of its
output by up to the L2's size (60 MB on an H200), which is why the shapes are large.

Without a CUDA GPU, or without ncu on the PATH (or ``--ncu`` / ``FLASHTILE_NCU``), it says so
and returns 0: nothing to measure here is not an error.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from . import traffic

MARKER = "flashtile_measure_marker"  # the kernel that opens each case's rows in ncu's CSV
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
IMPLS = ("naive", "flashtile")
PASSES = ("fwd", "bwd")
DTYPE_BYTES = 2  # bf16
NCU_CANDIDATES = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu")


@dataclass(frozen=True)
class Case:
    """One measured pass: (impl, pass) at (N, d) with ``heads`` heads, batch 1."""

    impl: str
    pass_: str
    n: int
    d: int
    heads: int

    @property
    def name(self) -> str:
        return f"{self.impl}-{self.pass_}-N{self.n}-d{self.d}"


@dataclass(frozen=True)
class KernelRow:
    """One kernel of ncu's CSV: its launch id, name and metric values (base units)."""

    id: int
    name: str
    metrics: dict


# ---------------------------------------------------------------------------------------
# The model's numbers for a case
# ---------------------------------------------------------------------------------------


def forward_tiles(d: int) -> tuple[int, int]:
    """(query rows, keys) of one tile pair of flashtile's sm90 forward at head dim d
    (`forward_sm90.BLOCK_M`, `default_block_n`; the same numbers without triton installed)."""
    try:
        from .ops.forward_sm90 import BLOCK_M, default_block_n
    except ImportError:  # the model stays usable with numpy alone
        return 128, (64 if d > 128 else 128)
    return BLOCK_M, default_block_n(d)


def split_backward_bytes(n: int, d: int, dtype_bytes: int = DTYPE_BYTES, *, keys_per_program: int = 128,
                         queries_per_program: int = 128, dq_keys: int = 128, q_step: int = 64) -> int:
    """HBM bytes of flashtile's split backward for one (batch, head), every re-read from HBM.

    Three kernels: the preprocess reads O and dO and writes D = rowsum(dO * O) (fp32); the
    dK/dV kernel holds ``keys_per_program`` keys and streams every visible query step of
    ``q_step`` rows (Q, dO, LSE, D again for each), writing dK and dV once; the dQ kernel
    holds ``queries_per_program`` queries and streams every visible K/V tile of ``dq_keys``
    (K, V again for each), writing dQ once. Not causal (every tile pair is visible).
    """
    b, st = dtype_bytes, traffic.STATS_BYTES
    pre = 2 * n * d * b + n * st  # read O, dO; write D
    kv_programs = math.ceil(n / keys_per_program)
    dkdv = 2 * n * d * b + kv_programs * n * (2 * d * b + 2 * st) + 2 * n * d * b
    q_programs = math.ceil(n / queries_per_program)
    dq = n * (2 * d * b + 2 * st) + q_programs * 2 * n * d * b + n * d * b
    del q_step  # every query row is loaded once per K/V program whatever the step
    return pre + dkdv + dq


def model_bytes(case: Case) -> dict:
    """{"compulsory": bytes, "no_cache": bytes} of ``case`` over all its heads."""
    n, d, h = case.n, case.d, case.heads
    compulsory = traffic.min_hbm_bytes(1, h, h, n, n, d, DTYPE_BYTES, case.pass_)
    backward = case.pass_ == "bwd"
    if case.impl == "naive":
        no_cache = traffic.memory_work(n, d, dtype_bytes=DTYPE_BYTES, backward=backward).naive.hbm_bytes * h
    elif backward:
        no_cache = split_backward_bytes(n, d) * h
    else:
        br, bc = forward_tiles(d)
        no_cache = traffic.memory_work(n, d, dtype_bytes=DTYPE_BYTES, Br=br, Bc=bc).flash.hbm_bytes * h
    return {"compulsory": int(compulsory), "no_cache": int(no_cache)}


# ---------------------------------------------------------------------------------------
# ncu's CSV
# ---------------------------------------------------------------------------------------


def _number(text: str) -> float:
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return float("nan")


def parse_ncu_csv(text: str) -> list[KernelRow]:
    """Kernels of ``ncu --csv --page details --print-units base`` output, in launch order.

    Lines that are not CSV records (ncu's ``==PROF==`` lines, the program's own output) are
    skipped; each kernel's metrics are collected from its "Metric Name"/"Metric Value" rows.
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    need = {"ID", "Kernel Name", "Metric Name", "Metric Value"}
    if not need <= set(reader.fieldnames or ()):
        raise ValueError(f"ncu CSV lacks the columns {sorted(need - set(reader.fieldnames or ()))}: "
                         "run ncu with --csv --page details")
    kernels: dict[int, KernelRow] = {}
    for rec in reader:
        kid = int(rec["ID"])
        row = kernels.setdefault(kid, KernelRow(kid, rec["Kernel Name"], {}))
        row.metrics[rec["Metric Name"]] = _number(rec["Metric Value"])
    return [kernels[k] for k in sorted(kernels)]


def split_cases(rows: Sequence[KernelRow], names: Sequence[str]) -> dict[str, list[KernelRow]]:
    """The kernels of each case: a row named `MARKER` opens the next name of ``names``."""
    out: dict[str, list[KernelRow]] = {}
    current = None
    it = iter(names)
    for row in rows:
        if MARKER in row.name:
            current = next(it, None)
            if current is None:
                raise ValueError(f"more {MARKER} kernels in the CSV than cases ({len(names)})")
            out[current] = []
        elif current is None:
            raise ValueError(f"kernel {row.name!r} (id {row.id}) before the first {MARKER}")
        else:
            out[current].append(row)
    missing = [n for n in names if n not in out]
    if missing:
        raise ValueError(f"no {MARKER} for the cases {missing}: the worker stopped early?")
    return out


def summarize(case: Case, kernels: Sequence[KernelRow]) -> dict:
    """One result row: measured bytes, the model's, and the share of re-reads the L2 took."""
    read = sum(k.metrics.get("dram__bytes_read.sum", 0.0) for k in kernels)
    write = sum(k.metrics.get("dram__bytes_write.sum", 0.0) for k in kernels)
    ns = sum(k.metrics.get("gpu__time_duration.sum", 0.0) for k in kernels)
    model = model_bytes(case)
    measured = read + write
    reread = model["no_cache"] - model["compulsory"]
    absorbed = (model["no_cache"] - measured) / reread if case.impl == "flashtile" and reread > 0 else None
    return {
        **asdict(case), "case": case.name, "kernels": len(kernels),
        "kernel_names": sorted({k.name.split("(")[0][:60] for k in kernels}),
        "read_bytes": read, "write_bytes": write, "measured_bytes": measured,
        "compulsory_bytes": model["compulsory"], "no_cache_bytes": model["no_cache"],
        "measured_over_compulsory": measured / model["compulsory"],
        "l2_absorbed": absorbed, "ncu_time_us": ns / 1e3,
    }


# ---------------------------------------------------------------------------------------
# Worker (runs under ncu, on the GPU)
# ---------------------------------------------------------------------------------------


def _case_thunk(case: Case):
    """Set up ``case`` on the GPU; return the zero-argument call to measure."""
    import torch

    import flashtile

    g = torch.Generator(device="cuda").manual_seed(case.n * 1000 + case.d)
    shape = (1, case.heads, case.n, case.d)  # naive: (B, H, S, D)

    def rand(grad=False):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)

    grad = case.pass_ == "bwd"
    if case.impl == "naive":
        q, k, v = rand(grad), rand(grad), rand(grad)
        scale = 1.0 / math.sqrt(case.d)

        def forward():
            # q is pre-scaled in the inputs' sense: the three kernels are Q K^T, softmax, P V.
            s = torch.matmul(q, k.transpose(-1, -2))
            return torch.matmul(torch.softmax(s, dim=-1), v)

        with torch.no_grad():
            q.mul_(scale)
    else:
        q, k, v = (x.transpose(1, 2).contiguous().requires_grad_(grad) for x in (rand(), rand(), rand()))

        def forward():
            return flashtile.flash_attn_func(q, k, v)

    if not grad:
        def run():
            with torch.no_grad():
                return forward()
        return run
    out = forward()
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)

    def run_bwd():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return run_bwd


def worker(cases: Sequence[Case], status_path: str) -> int:
    """Run each case once warm, then once between cudaProfilerStart/Stop after `MARKER`.

    Writes ``status_path`` (JSON): the names of the cases measured, in order, and those
    skipped with the reason (out of memory at the largest N, say).
    """
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def flashtile_measure_marker(x_ptr):
        tl.store(x_ptr, 1)

    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    flashtile_measure_marker[(1,)](flag)
    done, skipped = [], {}
    for case in cases:
        try:
            fn = _case_thunk(case)
            fn()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:  # the naive N x N arrays at the largest N
            skipped[case.name] = f"out of memory: {str(exc).splitlines()[0]}"
            torch.cuda.empty_cache()
            continue
        torch.cuda.cudart().cudaProfilerStart()
        flashtile_measure_marker[(1,)](flag)
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        done.append(case.name)
        del fn
        torch.cuda.empty_cache()
        Path(status_path).write_text(json.dumps({"measured": done, "skipped": skipped}))
    Path(status_path).write_text(json.dumps({"measured": done, "skipped": skipped}))
    return 0


# ---------------------------------------------------------------------------------------
# Parent: find ncu, run the worker under it, compare
# ---------------------------------------------------------------------------------------


def find_ncu(explicit: str | None = None) -> str | None:
    """ncu's path: ``explicit``, else FLASHTILE_NCU, else the PATH, else CUDA's usual places."""
    import glob

    for cand in (explicit, os.environ.get("FLASHTILE_NCU"), shutil.which("ncu")):
        if cand and Path(cand).is_file():
            return str(cand)
    for pattern in NCU_CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def why_not_here(ncu: str | None) -> str | None:
    """None when a measurement can run here, else the sentence that says why not."""
    try:
        import torch
    except ModuleNotFoundError:
        return "flashtile traffic --measure needs torch and a CUDA GPU: nothing measured (the model: flashtile traffic)"
    if not torch.cuda.is_available():
        return "flashtile traffic --measure needs a CUDA GPU; none is visible here, so nothing was measured"
    if ncu is None:
        return ("flashtile traffic --measure reads DRAM bytes with Nsight Compute, and ncu was not found "
                "(PATH, FLASHTILE_NCU, --ncu, /usr/local/cuda/bin, /opt/nvidia/nsight-compute): nothing measured")
    return None


def make_cases(seq_lengths: Iterable[int], head_dims: Iterable[int], heads: int,
               impls: Iterable[str] = IMPLS, passes: Iterable[str] = PASSES) -> list[Case]:
    """Every (d, N, impl, pass) case, small N first (a naive case that does not fit is skipped)."""
    cases = []
    for d in head_dims:
        for n in sorted(seq_lengths):
            for impl in impls:
                if impl not in IMPLS:
                    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
                for p in passes:
                    if p not in PASSES:
                        raise ValueError(f"pass must be one of {PASSES}, got {p!r}")
                    cases.append(Case(impl, p, int(n), int(d), int(heads)))
    return cases


def run_under_ncu(cases: Sequence[Case], ncu: str, workdir: Path, timeout: float = 540) -> tuple[str, dict, str]:
    """Run the worker under ncu; return (ncu's CSV text, the worker's status, an error
    message or ""). A worker that fails part-way still returns the cases it finished."""
    spec = workdir / "cases.json"
    status = workdir / "status.json"
    csv_path = workdir / "ncu.csv"
    spec.write_text(json.dumps([asdict(c) for c in cases]))
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", ",".join(METRICS),
           "--csv", "--page", "details", "--print-units", "base", "--log-file", str(csv_path),
           sys.executable, "-m", "flashtile.traffic_measure", "--worker", str(spec), str(status)]
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    error = ""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            error = f"ncu exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        error = f"the worker ran past {timeout:.0f} s"
    if not csv_path.exists() or not status.exists():
        raise RuntimeError(error or "ncu wrote no CSV")
    return csv_path.read_text(), json.loads(status.read_text()), error


def format_table(results: Sequence[dict]) -> str:
    """The measured-bytes table (GB = 1e9 bytes), one row per case."""
    head = (f"{'impl':<9} {'pass':<4} {'d':>4} {'N':>6} | {'read GB':>8} {'write GB':>8} {'measured':>9} | "
            f"{'compulsory':>10} {'no cache':>9} | {'meas/comp':>9} {'L2 took':>7} | kernels")
    out = [head, "-" * len(head)]
    for r in results:
        absorbed = "-" if r["l2_absorbed"] is None else f"{100 * r['l2_absorbed']:.0f}%"
        out.append(f"{r['impl']:<9} {r['pass_']:<4} {r['d']:>4} {r['n']:>6} | {r['read_bytes'] / 1e9:>8.3f} "
                   f"{r['write_bytes'] / 1e9:>8.3f} {r['measured_bytes'] / 1e9:>9.3f} | "
                   f"{r['compulsory_bytes'] / 1e9:>10.3f} {r['no_cache_bytes'] / 1e9:>9.3f} | "
                   f"{r['measured_over_compulsory']:>8.2f}x {absorbed:>7} | {r['kernels']}")
    return "\n".join(out)


def plot(results: Sequence[dict], path: str | Path) -> Path:
    """Log-log PNG: measured bytes against N beside the model's, one panel per pass."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.4))
    FigureCanvasAgg(fig)
    for i, p in enumerate(PASSES):
        ax = fig.add_subplot(1, 2, i + 1)
        for d in sorted({r["d"] for r in results}):
            rows = {impl: sorted((r for r in results if r["pass_"] == p and r["d"] == d and r["impl"] == impl),
                                 key=lambda r: r["n"]) for impl in IMPLS}
            for impl, marker in (("naive", "o"), ("flashtile", "s")):
                rs = rows[impl]
                if not rs:
                    continue
                ns = [r["n"] for r in rs]
                ax.loglog(ns, [r["measured_bytes"] for r in rs], marker + "-", label=f"{impl} measured, d{d}")
                ax.loglog(ns, [r["no_cache_bytes"] for r in rs], marker + ":", alpha=0.6,
                          label=f"{impl} model, no cache, d{d}")
            if rows["flashtile"]:
                ax.loglog([r["n"] for r in rows["flashtile"]], [r["compulsory_bytes"] for r in rows["flashtile"]],
                          "^--", alpha=0.6, label=f"compulsory, d{d}")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("DRAM bytes (all heads)")
        ax.set_title(f"{'forward' if p == 'fwd' else 'backward'}: ncu DRAM bytes vs the model")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def measure(seq_lengths: Sequence[int], head_dims: Sequence[int], *, heads: int = 16, ncu: str | None = None,
            out_dir: str | Path | None = None, plot_path: str | Path | None = None,
            impls: Iterable[str] = IMPLS, passes: Iterable[str] = PASSES) -> int:
    """``flashtile traffic --measure``: print the table (and write rows/plot); 0 on success or
    when nothing can be measured here (said on stdout), 1 if the measurement failed."""
    ncu = find_ncu(ncu)
    reason = why_not_here(ncu)
    if reason:
        print(reason)
        return 0
    import torch

    cases = make_cases(seq_lengths, head_dims, heads, impls, passes)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            text, status, error = run_under_ncu(cases, ncu, Path(tmp))
        except RuntimeError as exc:
            print(f"the measurement failed: {exc}", file=sys.stderr)
            return 1
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "ncu-traffic.csv").write_text(text)
    measured = status["measured"]
    by_case = split_cases(parse_ncu_csv(text), measured)
    lookup = {c.name: c for c in cases}
    results = [summarize(lookup[name], by_case[name]) for name in measured]
    gpu = torch.cuda.get_device_name()
    print(f"DRAM bytes by Nsight Compute ({Path(ncu).name}, L2 flushed before each kernel) on {gpu}; "
          f"batch 1, {heads} heads, bf16, not causal")
    print(format_table(results))
    for name, why in status["skipped"].items():
        print(f"skipped {name}: {why}")
    if error:
        print(f"the worker stopped after {len(measured)} of {len(cases)} cases: {error}", file=sys.stderr)
    if out_dir is not None:
        rows = Path(out_dir) / "traffic-measured.jsonl"
        with rows.open("w") as f:
            for r in results:
                f.write(json.dumps({**r, "gpu": gpu, "torch": torch.__version__}) + "\n")
        print(f"wrote {rows}")
    if plot_path is not None:
        print(f"wrote {plot(results, plot_path)}")
    return 1 if error else 0


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 3 and argv[0] == "--worker":
        cases = [Case(**c) for c in json.loads(Path(argv[1]).read_text())]
        return worker(cases, argv[2])
    print("usage: flashtile traffic --measure ... (this module's own entry is the ncu worker)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

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

For flashtile the share of the re-read traffic that the L2 absorbed is, on reads (every
re-read is a read), (no cache - measured) / (no cache - kernel floor), where the kernel
floor is each kernel reading each of its inputs once (`model_bytes`): 1.0 when HBM saw no
tile re-read, 0.0 when every re-read reached it. The backward's floor is twice its
compulsory reads: its dK/dV and dQ kernels both read Q, K, V and dO (and ncu's flush
between kernels keeps the second from finding the first's lines in the L2).

How it is measured. The parent process starts ``ncu --profile-from-start off`` on a worker
(``python -m flashtile.tools.traffic_measure --worker``) that sets up each case, runs it once to
compile and warm up, then runs it again between ``cudaProfilerStart`` and
``cudaProfilerStop`` behind a one-thread marker kernel (`MARKER`), so the kernels of a
case are the rows between two markers of ncu's CSV. ncu's default cache control flushes
the L2 before every kernel, so each kernel starts cold: a kernel's re-reads can hit lines
it brought in itself, not lines an earlier kernel left. Dirty lines still in the L2 when a
kernel ends are written back outside it: a kernel's counted writes fall short of its output
by up to the L2's size (60 MB on an H200), so writes are reported but the comparison that
matters is on reads.

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

from flashtile import traffic

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
    (`backends.sm90.forward.BLOCK_M`, `default_block_n`; the same numbers without triton installed)."""
    try:
        from flashtile.backends.sm90.forward import BLOCK_M, default_block_n
    except ImportError:  # the model stays usable with numpy alone
        return 128, (64 if d > 128 else 128)
    return BLOCK_M, default_block_n(d)


def split_backward_bytes(n: int, d: int, dtype_bytes: int = DTYPE_BYTES, *, keys_per_program: int = 128,
                         queries_per_program: int = 128) -> tuple[int, int]:
    """(read, written) HBM bytes of flashtile's split backward for one (batch, head), every
    re-read from HBM.

    Three kernels: the preprocess reads O and dO and writes D = rowsum(dO * O) (fp32); the
    dK/dV kernel holds ``keys_per_program`` keys, reads K and V once and every query row's
    Q, dO, LSE and D again for each such program, and writes dK and dV once; the dQ kernel
    holds ``queries_per_program`` queries, reads Q, dO, LSE and D once and K and V again for
    each such program, and writes dQ once. Not causal (every tile pair is visible).
    """
    b, st = dtype_bytes, traffic.STATS_BYTES
    rows = n * d * b  # one N x d tensor
    kv_programs = math.ceil(n / keys_per_program)
    q_programs = math.ceil(n / queries_per_program)
    read = (2 * rows  # preprocess: O, dO
            + 2 * rows + kv_programs * n * (2 * d * b + 2 * st)  # dK/dV: K, V; Q, dO, LSE, D per program
            + n * (2 * d * b + 2 * st) + q_programs * 2 * rows)  # dQ: Q, dO, LSE, D; K, V per program
    written = n * st + 2 * rows + rows  # D; dK, dV; dQ
    return read, written


def model_bytes(case: Case) -> dict:
    """The model's bytes of ``case`` over all its heads: ``compulsory`` (every tensor moved
    once) and ``no_cache`` (every re-read from HBM), each also split into ``*_read`` and
    ``*_write``; ``kernel_floor_read``: each kernel of the algorithm reads each of its inputs
    once (for the split backward twice the compulsory reads: both main kernels read Q, K, V
    and dO; for the forward and naive the compulsory reads of their ledgers)."""
    n, d, h, b = case.n, case.d, case.heads, DTYPE_BYTES
    backward = case.pass_ == "bwd"
    compulsory = traffic.min_hbm_bytes(1, h, h, n, n, d, b, case.pass_)
    # fwd writes out and the LSE; bwd writes dq, dk, dv (all of one head count here).
    compulsory_write = h * (3 * n * d * b if backward else n * d * b + n * traffic.STATS_BYTES)
    floor_read = None
    if case.impl == "flashtile" and backward:
        read, written = split_backward_bytes(n, d, b)
        floor_read = split_backward_bytes(n, d, b, keys_per_program=n, queries_per_program=n)[0]
    else:
        if case.impl == "naive":
            work = traffic.memory_work(n, d, dtype_bytes=b, backward=backward).naive
        else:
            br, bc = forward_tiles(d)
            work = traffic.memory_work(n, d, dtype_bytes=b, Br=br, Bc=bc).flash
        read = sum(line.reads_bytes for line in work.ledger)
        written = sum(line.writes_bytes for line in work.ledger)
        floor_read = sum(line.reads_bytes for line in work.ledger if not line.is_reread)
    return {"compulsory": int(compulsory), "compulsory_read": int(compulsory - compulsory_write),
            "kernel_floor_read": int(h * floor_read),
            "compulsory_write": int(compulsory_write), "no_cache": int(h * (read + written)),
            "no_cache_read": int(h * read), "no_cache_write": int(h * written)}


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
    """One result row: measured bytes, the model's, and the share of re-reads the L2 took.

    The share is computed on reads: every re-read of the model is a read, and the counted
    writes fall short when the output can stay in the L2 past the kernel's end."""
    read = sum(k.metrics.get("dram__bytes_read.sum", 0.0) for k in kernels)
    write = sum(k.metrics.get("dram__bytes_write.sum", 0.0) for k in kernels)
    ns = sum(k.metrics.get("gpu__time_duration.sum", 0.0) for k in kernels)
    model = model_bytes(case)
    reread = model["no_cache_read"] - model["kernel_floor_read"]
    absorbed = (model["no_cache_read"] - read) / reread if case.impl == "flashtile" and reread > 0 else None
    return {
        **asdict(case), "case": case.name, "kernels": len(kernels),
        "kernel_names": sorted({k.name.split("(")[0][:60] for k in kernels}),
        "read_bytes": read, "write_bytes": write, "measured_bytes": read + write,
        **{f"{key}_bytes": value for key, value in model.items()},
        "measured_over_compulsory": (read + write) / model["compulsory"],
        "read_over_compulsory_read": read / model["compulsory_read"],
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
        del fn  # its memory stays in torch's cache: memory handed back to the driver and
        # taken again can be written by the driver during a later kernel, which the
        # device-wide DRAM counters would charge to that kernel (run 75: 0.96 GB "written"
        # by a forward whose output is 34 MB, right after empty_cache released 35 GB)
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
           sys.executable, "-m", "flashtile.tools.traffic_measure", "--worker", str(spec), str(status)]
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
    head = (f"{'impl':<9} {'pass':<4} {'d':>4} {'N':>6} | {'read GB':>8} {'write GB':>8} | "
            f"{'comp. rd':>8} {'floor rd':>8} {'no-cache rd':>11} {'comp. wr':>8} | {'rd/comp':>8} {'L2 took':>7} | kernels")
    out = [head, "-" * len(head)]
    for r in results:
        absorbed = "-" if r["l2_absorbed"] is None else f"{100 * r['l2_absorbed']:.1f}%"
        out.append(f"{r['impl']:<9} {r['pass_']:<4} {r['d']:>4} {r['n']:>6} | {r['read_bytes'] / 1e9:>8.3f} "
                   f"{r['write_bytes'] / 1e9:>8.3f} | {r['compulsory_read_bytes'] / 1e9:>8.3f} "
                   f"{r['kernel_floor_read_bytes'] / 1e9:>8.3f} {r['no_cache_read_bytes'] / 1e9:>11.3f} "
                   f"{r['compulsory_write_bytes'] / 1e9:>8.3f} | "
                   f"{r['read_over_compulsory_read']:>7.2f}x {absorbed:>7} | {r['kernels']}")
    return "\n".join(out)


def plot(results: Sequence[dict], path: str | Path) -> Path:
    """Log-log PNG: DRAM bytes read against N beside the model's reads, one panel per pass."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.6))
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
                ax.loglog(ns, [r["read_bytes"] for r in rs], marker + "-", label=f"{impl} measured, d{d}")
                ax.loglog(ns, [r["no_cache_read_bytes"] for r in rs], marker + ":", alpha=0.6,
                          label=f"{impl} model, every re-read from HBM, d{d}")
            if rows["flashtile"]:
                ax.loglog([r["n"] for r in rows["flashtile"]],
                          [r["compulsory_read_bytes"] for r in rows["flashtile"]],
                          "^--", alpha=0.6, label=f"compulsory, d{d}")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("DRAM bytes read (all heads)")
        ax.set_title(f"{'forward' if p == 'fwd' else 'backward'}: ncu DRAM reads vs the model")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def report(text: str, measured: Sequence[str], cases: Sequence[Case], *, gpu: str, heads: int,
           out_dir: str | Path | None = None, plot_path: str | Path | None = None, extra: dict | None = None
           ) -> list[dict]:
    """Rows of ncu's CSV ``text`` for the cases named in ``measured`` (in the order the worker
    ran them): print the table, write ``traffic-measured.jsonl`` under ``out_dir`` and the
    plot. Also what ``--from-csv`` runs on a saved CSV, with no GPU."""
    by_case = split_cases(parse_ncu_csv(text), measured)
    lookup = {c.name: c for c in cases}
    results = [summarize(lookup[name], by_case[name]) for name in measured]
    print(f"DRAM bytes by Nsight Compute (L2 flushed before each kernel) on {gpu}; "
          f"batch 1, {heads} heads, bf16, not causal; GB = 1e9 bytes")
    print(format_table(results))
    if out_dir is not None:
        rows = Path(out_dir) / "traffic-measured.jsonl"
        with rows.open("w") as f:
            for r in results:
                f.write(json.dumps({**r, "gpu": gpu, **(extra or {})}) + "\n")
        print(f"wrote {rows}")
    if plot_path is not None:
        print(f"wrote {plot(results, plot_path)}")
    return results


def measure(seq_lengths: Sequence[int], head_dims: Sequence[int], *, heads: int = 16, ncu: str | None = None,
            out_dir: str | Path | None = None, plot_path: str | Path | None = None,
            impls: Iterable[str] = IMPLS, passes: Iterable[str] = PASSES, from_csv: str | Path | None = None,
            gpu_name: str | None = None) -> int:
    """``flashtile traffic --measure``: print the table (and write rows/plot); 0 on success or
    when nothing can be measured here (said on stdout), 1 if the measurement failed.

    ``from_csv``: no measurement; read the ``ncu-traffic.csv`` an earlier run saved (its
    cases are those of ``seq_lengths``, ``head_dims`` and ``heads``, all measured; ``gpu_name``
    names the GPU it ran on in the rows)."""
    cases = make_cases(seq_lengths, head_dims, heads, impls, passes)
    if from_csv is not None:
        text = Path(from_csv).read_text()
        report(text, [c.name for c in cases], cases, gpu=gpu_name or "the GPU of the saved run", heads=heads,
               out_dir=out_dir, plot_path=plot_path)
        return 0
    ncu = find_ncu(ncu)
    reason = why_not_here(ncu)
    if reason:
        print(reason)
        return 0
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        try:
            text, status, error = run_under_ncu(cases, ncu, Path(tmp))
        except RuntimeError as exc:
            print(f"the measurement failed: {exc}", file=sys.stderr)
            return 1
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "ncu-traffic.csv").write_text(text)
    report(text, status["measured"], cases, gpu=torch.cuda.get_device_name(), heads=heads, out_dir=out_dir,
           plot_path=plot_path, extra={"torch": torch.__version__})
    for name, why in status["skipped"].items():
        print(f"skipped {name}: {why}")
    if error:
        print(f"the worker stopped after {len(status['measured'])} of {len(cases)} cases: {error}", file=sys.stderr)
    return 1 if error else 0


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 3 and argv[0] == "--worker":
        cases = [Case(**c) for c in json.loads(Path(argv[1]).read_text())]
        return worker(cases, argv[2])
    print("usage: flashtile traffic --measure ... (this module's own entry is the ncu worker)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

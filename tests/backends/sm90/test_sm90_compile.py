"""Every sm90 table configuration compiles for Hopper, fits shared memory, uses wgmma.

Runs on CPU: Triton compiles ahead of time for an sm90 target with its bundled ptxas
(see flashtile.tools.sm90_check). A subprocess, because TRITON_INTERPRET=1 (set for the
rest of the suite) makes @triton.jit build interpreter functions that cannot compile.
Checks that read only shared memory and PTX stop before ptxas (``sm90_check.ptx_only``:
the flex, packed-sequence and Triton backward kernels); every check of registers, spills
or machine code runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from flashtile.tools.sm90_check import SM90_SHARED_LIMIT  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _compile_run(tmp_path, *args: str) -> str:
    """stdout of ``python *args`` without the interpreter, with its own Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _report(out: str, names) -> list[tuple[str, dict[str, str]]]:
    """The compile report lines of ``out`` whose first word is in ``names``, each with its
    ``key=value`` fields."""
    return [(line, dict(f.split("=") for f in line.split()[1:]))
            for line in out.splitlines() if line.split(" ")[0] in names]


@pytest.mark.slow(seconds=200)
@pytest.mark.parametrize("head_dim", [pytest.param(64, marks=pytest.mark.exhaustive), 128,
                                      pytest.param(256, marks=pytest.mark.exhaustive)])  # one per case (xdist)
def test_sm90_table_compiles_and_fits(tmp_path, head_dim):
    """Every table configuration at ``head_dim`` builds sm_90a PTX within shared memory with
    wgmma; the plain forward kernels go through ptxas (registers, spills), the Triton backward
    kernels and the masked forwards stop at the PTX (``sm90_check.ptx_only``: a third of
    the time; the GPU tests run them)."""
    out = _compile_run(tmp_path, "-m", "flashtile.tools.sm90_check", "--ptx-only", "--regs-match",
                       "^fwd(-ws)? .*(mask=0|num_buf)", "--headdim", str(head_dim))
    assert out.count("ok  ") >= 12, out  # the checks really ran (13-15 per head dim)
    assert f" d{head_dim} " in out and not any(f" d{d} " in out for d in (64, 128, 256) if d != head_dim), out
    # The plain forward (no explicit mask) holds its tiles in registers without spilling;
    # the H200 speed of the table rests on it. (Masked forwards and the backward kernels
    # do spill today: docs/perf-notes.md.)
    plain_fwd = [line for line in out.splitlines() if " fwd " in line and "mask=0" in line]
    assert len(plain_fwd) >= 2, out
    spilling = [line for line in plain_fwd if " spill=    0B" not in line]
    assert not spilling, "\n".join(spilling)


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=40)
def test_gluon_forward_experiment_compiles_with_the_overlap(tmp_path):
    """benchmarks/experiments/gluon_fwd.py (H200 runs 16-18): both kernels compile for sm_90a
    without spills, the warp-specialized one redistributes registers, and the loop's PTX
    issues the softmax's exp2 after a wait_group 1 (P V still in flight). This checks the
    PTX only: in the library's forward ptxas hoists the next wait_group 0 above the exp2,
    the schedule the H200 measured as the faster one (docs/perf-notes.md, run 40)."""
    out = _compile_run(tmp_path, str(ROOT / "benchmarks" / "experiments" / "gluon_fwd.py"), "--compile")
    lines = out.splitlines()
    heads, schedules = lines[0::2], lines[1::2]
    assert len(heads) == 6, out
    # The library's persistent kernel may keep a scalar or two of its work loop in local
    # memory (44 bytes at causal d128: two 4-byte values); the tiles themselves must not spill.
    spills = [int(re.search(r" spill=(\d+)B ", h).group(1)) for h in heads]
    assert all(n == 0 for h, n in zip(heads, spills) if not h.startswith("ws ")), out
    assert all(n <= 64 for n in spills), out
    assert all("setmaxnreg=0" not in h for h in heads if h.startswith("ws ")), out
    for sched in schedules:
        assert "WAIT1" in sched and sched.index("WAIT1") < sched.index("EX2x", sched.index("WAIT1")), sched


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=120)
def test_gluon_backward_compiles_with_the_overlap(tmp_path):
    """backends/sm90/backward_split.py: every kernel compiles for sm_90a within shared memory,
    redistributes registers, keeps the previous step's products in flight over the
    elementwise work (dK/dV: wait_group 2; dQ, and d256's dV and dK: wait_group 1), and
    does not spill (the causal d128 dK/dV kernel keeps up to 160 bytes in its diagonal
    branch, the plain one 8 after its loop, d256's causal dK kernel 12 bytes of loop
    scalars, allowed up to 16); the overlap is checked in the machine code, where ptxas schedules."""
    script = (
        "from flashtile.tools.sm90_check import compile_backward_ws, ex2_under_wait\n"
        "for d in (64, 128, 256):\n"
        "    for causal in (False, True):\n"
        "        for c in compile_backward_ws('bf16', d, causal=causal):\n"
        "            regs, spill = c.registers()\n"
        "            in_flight = 2 if c.name.startswith('bwd-ws-dkdv') else 1\n"
        "            ex2 = ','.join(map(str, ex2_under_wait(c.sass(), in_flight)))\n"
        "            print(c.name.split()[0], f'd={d} causal={int(causal)} spill={spill} smem={c.shared}',\n"
        "                  f\"setmaxnreg={c.ptx.count('setmaxnreg')}\",\n"
        "                  f\"wait1={c.ptx.count('wgmma.wait_group.sync.aligned 1')}\",\n"
        "                  f\"wait2={c.ptx.count('wgmma.wait_group.sync.aligned 2')}\", f'ex2={ex2}', flush=True)\n"
    )
    out = _compile_run(tmp_path, "-c", script)
    lines = _report(out, ("bwd-ws-dkdv", "bwd-ws-dq", "bwd-ws-dv", "bwd-ws-dk"))
    assert len(lines) == 4 * 2 + 2 * 3, out
    for line, fields in lines:
        assert int(fields["smem"]) <= SM90_SHARED_LIMIT and int(fields["setmaxnreg"]) > 0, line
        overlap = "wait2" if line.startswith("bwd-ws-dkdv") else "wait1"
        assert int(fields[overlap]) > 0, line
        # In the machine code too: each consumer's loop runs the exp2 of its tile (64 x 64:
        # 32 per thread; d256's dQ tile of 64 x 32: 16 per thread and branch) before it
        # waits for the products in flight (ptxas hoisted that wait above them while the
        # elementwise work was one basic block: H200 run 40).
        ex2 = [int(n) for n in fields["ex2"].split(",")]
        consumers = 1 if line.startswith("bwd-ws-dk ") else 2
        per_thread = 16 if line.startswith("bwd-ws-dq") and "d=256" in line else 32
        assert len(ex2) >= consumers and min(ex2) >= per_thread, line
        limit = 0
        if line.startswith("bwd-ws-dkdv"):  # d128 non-causal: one value stored and reloaded once, after the loop
            limit = 160 if "causal=1" in line else 8
        if line.startswith("bwd-ws-dk ") and "causal=1" in line:  # its 3-slot Q ring's loop scalars
            limit = 16
        assert int(fields["spill"]) <= limit, line


@pytest.mark.exhaustive  # the deterministic d64 default since run 216; its GPU tests build it too
@pytest.mark.slow(seconds=30)
def test_split_backward_128_query_steps_do_not_spill(tmp_path):
    """The split backward's dK/dV kernel at 128 queries per step (``dkdv_block_q=128``, d64,
    3 ring slots: 197 KB): its loop makes the fixed tiles' views anew each step, so ptxas
    keeps their wgmma descriptors out of local memory (324 B of spills plain and 828 B causal
    with them hoisted, sm_90a; 16 B of causal loop scalars remain)."""
    script = (
        "from flashtile.tools.sm90_check import compile_backward_ws\n"
        "for causal in (False, True):\n"
        "    c = compile_backward_ws('bf16', 64, causal=causal, dkdv_block_q=128, dkdv_num_buf=3)[0]\n"
        "    regs, spill = c.registers()\n"
        "    print('dkdv128', f'causal={int(causal)} spill={spill} smem={c.shared}', flush=True)\n"
    )
    lines = _report(_compile_run(tmp_path, "-c", script), ("dkdv128",))
    assert len(lines) == 2, lines
    for line, fields in lines:
        assert int(fields["smem"]) <= SM90_SHARED_LIMIT, line
        assert int(fields["spill"]) <= (16 if fields["causal"] == "1" else 0), line


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("cases", [((128, False), (128, True)),
                                   pytest.param(((64, False), (256, False)), marks=pytest.mark.exhaustive)],
                         ids=["d128", "d64-d256"])
def test_gluon_forward_dynamic_schedule_compiles(tmp_path, cases):
    """ops/forward_sm90.fwd_ws_dyn_kernel (the dynamic schedule): compiles
    for sm_90a within shared memory, redistributes registers, claims items with one
    atomic per claim (the first and the loop's) plus the exchange that resets the counter
    for the next launch, and keeps its tiles out of local memory (the causal d128 kernel
    spills loop scalars: 128 bytes); with an attention sink too (d128: its epilogue reads
    the sink, one more global load). ``cases`` (head dim, sink): d128 with and without a
    sink in make test, d64 and d256 in make test-exhaustive (the GPU tests build them too)."""
    script = (
        "from flashtile.tools.sm90_check import compile_forward_ws\n"
        f"for d, sink in {cases!r}:\n"
        "    c = compile_forward_ws('bf16', d, causal=True, dynamic=True, sink=sink)\n"
        "    regs, spill = c.registers()\n"
        "    print('dyn', f'd={d} sink={sink} spill={spill} smem={c.shared}', f\"setmaxnreg={c.ptx.count('setmaxnreg')}\",\n"
        "          f\"atom={c.ptx.count('atom.global')}\", f\"exch={c.ptx.count('.exch.')}\",\n"
        "          f\"loads={c.ptx.count('ld.global')}\", flush=True)\n"
    )
    out = _compile_run(tmp_path, "-c", script)
    lines = _report(out, ("dyn",))
    assert len(lines) == len(cases), out
    loads = {(f["d"], f["sink"]): int(f["loads"]) for _, f in lines}
    if ("128", "True") in loads:
        assert loads[("128", "True")] > loads[("128", "False")], loads
    for line, fields in lines:
        assert int(fields["smem"]) <= SM90_SHARED_LIMIT and int(fields["setmaxnreg"]) > 0, line
        assert int(fields["atom"]) == 3 and int(fields["exch"]) == 1 and int(fields["spill"]) <= 128, line


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=190)
def test_varlen_kernels_compile(tmp_path):
    """The packed-sequence variants: the Gluon forward on a work list (d64/128/256) and the
    Gluon dK/dV and dQ kernels (d64/128), and the Triton forward and backward kernels with
    VARLEN, all build sm_90a PTX within shared memory; the Gluon forward still claims
    items with one atomic per claim (and resets its counter with one exchange). PTX only
    (``sm90_check.ptx_only``): whether ptxas takes them shows in the GPU tests."""
    script = (
        "from flashtile.backends import configs\n"
        "from flashtile.tools.sm90_check import compile_backward, compile_backward_ws, compile_forward, compile_forward_ws\n"
        "from flashtile.tools.sm90_check import ptx_only\n"
        "with ptx_only():\n"
        "    for d in (64, 128, 256):\n"
        "        for causal in (False, True):\n"
        "            c = compile_forward_ws('bf16', d, causal=causal, varlen=True)\n"
        "            print('varlen', f'kind=fwd-ws d={d} smem={c.shared} atom={c.ptx.count(\"atom.global\")}', flush=True)\n"
        "            ks = compile_backward_ws('bf16', d, causal=causal, varlen=True) if d < 256 else []\n"
        "            for c in ks:\n"
        "                print('varlen', f'kind=bwd-ws d={d} smem={c.shared} atom=0', flush=True)\n"
        "        fwd = configs.default_fwd_config((9, 0), d, 'bfloat16', True, 4096)\n"
        "        c = compile_forward(fwd, 'bf16', d, causal=True, extras=True, varlen=True)\n"
        "        print('varlen', f'kind=fwd d={d} smem={c.shared} atom=0', flush=True)\n"
        "        bwd = configs.default_bwd_config((9, 0), d, 'bfloat16')\n"
        "        for c in compile_backward(bwd, 'bf16', d, extras=True, varlen=True):\n"
        "            print('varlen', f'kind=bwd d={d} smem={c.shared} atom=0', flush=True)\n"
    )
    out = _compile_run(tmp_path, "-c", script)
    lines = _report(out, ("varlen",))
    assert len(lines) == 6 + 8 + 3 + 6, out
    for line, fields in lines:
        assert int(fields["smem"]) <= SM90_SHARED_LIMIT, line
        if fields["kind"] == "fwd-ws":
            assert int(fields["atom"]) == 3, line


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("head_dims", [(128,), pytest.param((64, 256), marks=pytest.mark.exhaustive)],
                         ids=lambda dims: "-".join(f"d{d}" for d in dims))
def test_decode_kernels_compile_for_sm90(tmp_path, head_dims):
    """backends/triton/decode.py's check, append, decode and combine kernels build sm_90a PTX at
    ``head_dims`` (d128 in make test, d64 and d256 in make test-exhaustive), row and paged
    caches, split and not, every option: the interpreter runs what the compiler refuses (a
    non-constexpr global read in a kernel, H200 run 65). ptxas runs for the plain decode
    kernels, whose registers and spills are checked (for the rest, whether ptxas takes them
    shows in the GPU tests: ``sm90_check.ptx_only``)."""
    out = _compile_run(tmp_path, "-m", "flashtile.tools.sm90_check", "--decode", "--ptx-only",
                       "--regs-match", "^decode bf16 .* extras=False", "--headdim", *map(str, head_dims))
    lines = [line for line in out.splitlines() if line.startswith(("ok  ", "FAIL"))]
    n, d128 = len(head_dims), int(128 in head_dims)  # d128 alone builds the paged spread's finish
    assert len(lines) == 41 * n + 2 * d128 and all(line.startswith("ok  ") for line in lines), out
    for kind, per_dim in (("decode-check", 9), ("decode-append", 11), ("decode-combine", 8)):
        assert sum(f" {kind} " in line for line in lines) == n * per_dim, out
    assert sum(" decode-finish " in line for line in lines) == n + d128, out
    # the plain decode kernels (the bandwidth-bound loop) keep their tiles in registers
    plain = [line for line in lines if " decode bf16 " in line and "extras=False" in line]
    assert len(plain) == 11 * n + d128 and all(" spill=    0B" in line for line in plain), "\n".join(plain)
    if d128:
        # appending the new keys in the decode kernel (the default) costs the loop no
        # registers: its append loop takes one token a step (APPEND_T=1, a decode step's)
        regs = {" append=separate" in line: int(re.search(r"regs=\s*(\d+)", line).group(1))
                for line in plain if "rows=4 paged=0 extras=False split=True" in line and " d128 " in line
                and "combine=fused" not in line}
        assert regs[False] <= regs[True], regs
    # a page that holds whole key tiles pipelines like a row cache: K and V double-buffered
    # (decode.STAGES["tile"]; at 3 stages Triton gave them one buffer, H200 run 68); so does
    # the page-16 gather with its table slice in registers (decode.PAGE_SLICE_MAX)
    smem = {}
    for line in plain:
        m = re.search(r"smem=\s*(\d+) .* decode bf16 (d\d+) rows=4 paged=(\d+) extras=False( slice=\d+)? "
                      r"split=True", line)
        if m:
            smem[(m.group(3) + (m.group(4) or ""), m.group(2))] = int(m.group(1))
    for d in (f"d{d}" for d in head_dims):
        assert smem[("256", d)] >= smem[("0", d)], smem
        assert smem[("16 slice=128", d)] >= smem[("0", d)] > smem[("16", d)], smem
    # the metadata check inside the decode kernel (FLASHTILE_DECODE_CHECK=fused) takes no
    # shared memory from the key pipeline: the check runs before the loop, in registers
    fused = [line for line in plain if " check=fused " in line]
    assert len(fused) == 2 * n
    for line in fused:
        twin = line.replace(" check=fused", "").split("B  ", 1)[1]
        base = next(x for x in plain if x.split("B  ", 1)[1] == twin)
        assert re.search(r"smem=\s*(\d+)", line).group(1) == re.search(r"smem=\s*(\d+)", base).group(1), (line, base)
    # the spread check (a captured step's default) costs the row cache's loop no shared memory
    # and at most 8 registers: its check runs before the loop, its new key in a tile of 16 after
    for d in head_dims:
        base, spread = (next(x for x in plain if f" decode bf16 d{d} rows=4 paged=0 extras=False {c}split=True" in x)
                        for c in ("", "check=spread "))
        (s0, r0), (s1, r1) = (map(int, re.search(r"smem=\s*(\d+) .* regs=\s*(\d+)", x).groups()) for x in (base, spread))
        assert s1 == s0 and r1 <= r0 + 8, (base, spread)


@pytest.mark.slow(seconds=25)
def test_decode_kernel_orders_its_append_and_its_combine(tmp_path):
    """What the fused append and the fused combine rely on, in sm_90a PTX (a Triton upgrade
    could move it): the append's global stores, then a CTA barrier, then the pipeline's
    first cp.async of a key tile (the loads read the new keys back from the cache); and the
    combine's acq_rel ticket, then a CTA barrier, then the winner's L2 (.cg) loads of the
    other programs' partials."""
    code = ("import re\n"
            "from flashtile.tools.sm90_check import compile_decode, ptx_only\n"
            "with ptx_only():\n"
            "    c = next(k for k in compile_decode('bf16', 64, rows=4, fused_combine=True)"
            " if k.name.startswith('decode bf16'))\n"
            "lines = c.ptx.splitlines()\n"
            "def first(pat, after=0):\n"
            "    return next(i for i in range(after, len(lines)) if re.search(pat, lines[i]))\n"
            "load = first(r'cp\\.async\\.c[ga]')\n"
            "stores = [i for i in range(load) if 'st.global' in lines[i]]\n"
            "bars = [i for i in range(max(stores, default=0), load) if 'bar.sync' in lines[i]]\n"
            "atom = first(r'atom\\..*acq_rel')\n"
            "cg = first(r'ld\\.global\\.cg', atom)\n"
            "print(len(stores), len(bars), sum('bar.sync' in lines[i] for i in range(atom, cg)))")
    stores, bars, combine_bars = map(int, _compile_run(tmp_path, "-c", code).split())
    assert stores > 0 and bars > 0 and combine_bars > 0, (stores, bars, combine_bars)


@pytest.mark.slow(seconds=20)
def test_decode_pdl_waits_before_it_touches_memory(tmp_path):
    """FLASHTILE_PDL=on (sm_90a PTX): the decode kernel waits for the kernels before it
    (griddepcontrol.wait) and then lets the combine launch, before its first global load,
    store, cp.async or atomic; the combine waits before its first load (at d128 and at MLA's
    576 / 512). Without PDL neither kernel has a griddepcontrol instruction."""
    code = ("import re\n"
            "from flashtile.tools.sm90_check import compile_decode, ptx_only\n"
            "mem = re.compile(r'(ld|st)\\.global|cp\\.async\\.c|atom\\.|red\\.')\n"
            "def order(ptx):\n"
            "    lines = ptx.splitlines()\n"
            "    first = lambda pat: next((i for i, l in enumerate(lines) if re.search(pat, l)), -1)\n"
            "    return first('griddepcontrol\\.wait'), first('griddepcontrol\\.launch_dependents'), first(mem)\n"
            "with ptx_only():\n"
            "    for pdl in (True, False):\n"
            "        for hd, hv, rows in ((128, 0, 4), (576, 512, 16)):  # MLA's absorbed decode too\n"
            "            for k in compile_decode('bf16', hd, rows=rows, head_dim_v=hv, pdl=pdl):\n"
            "                if k.name.startswith(('decode bf16', 'decode-combine')):\n"
            "                    print(k.name.split()[0], hd, pdl, *order(k.ptx))\n")
    got = {}
    for line in _compile_run(tmp_path, "-c", code).splitlines():
        name, hd, pdl, wait, launch, mem = line.split()
        got[(name, int(hd), pdl == "True")] = (int(wait), int(launch), int(mem))
    assert len(got) == 8, got
    for hd in (128, 576):
        wait, launch, mem = got[("decode", hd, True)]
        assert 0 <= wait < launch < mem, got
        wait, launch, mem = got[("decode-combine", hd, True)]
        assert 0 <= wait < mem and launch == -1, got
        assert all(got[(name, hd, False)][:2] == (-1, -1) for name in ("decode", "decode-combine")), got


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=30)
def test_wide_head_dims_compile_and_fit(tmp_path):
    """Issue 36's shapes build for sm_90a and fit shared memory: the forward and backward at
    head dim 512 and at (192, 128), the fused-dQ backward at 512, MLA's absorbed decode (576
    / 512) over row and paged caches. The plain forward at (192, 128) keeps its tiles in
    registers; the rest spill (unmeasured on a device: docs/perf-notes.md)."""
    # ptxas only for the kernels whose registers are checked below (the rest to the PTX,
    # where shared memory is known: whether ptxas takes them shows in the GPU tests)
    out = _compile_run(tmp_path, "-m", "flashtile.tools.sm90_check", "--wide", "--ptx-only",
                       "--regs-match", "^fwd bf16 d192-128 ")
    lines = [line for line in out.splitlines() if line.startswith(("ok  ", "FAIL"))]
    assert len(lines) == 4 + 2 * 2 + 1 + 3 * 4 and all(line.startswith("ok  ") for line in lines), out
    for dims in (" d512 ", " d192-128 ", " d576-512 "):
        assert any(dims in line for line in lines), out
    plain = [line for line in lines if " fwd bf16 d192-128 " in line]
    assert len(plain) == 2 and all(" spill=    0B" in line for line in plain), "\n".join(plain)


def test_gluon_tma_reduce_compiles_to_a_bulk_reduction(tmp_path):
    """Issue 17's first fact: triton 3.6's libtriton builds a bulk tensor reduction from shared
    memory for Gluon (``backends.sm90.tma_reduce``, the builder the public ``tma`` module does not
    export), and it lowers to FA3's instruction for sm_90a, issued once per tile, waited on
    as a bulk group."""
    code = ("from flashtile.tools.sm90_check import compile_tma_reduce_probe as f, ptx_only\n"
            "with ptx_only():\n    c = f()\n"
            "print('\\n'.join(l.strip() for l in c.ptx.splitlines() if 'bulk' in l and not l.strip().startswith('//')))")
    out = _compile_run(tmp_path, "-c", code)
    reduces = [line for line in out.splitlines() if "cp.reduce" in line]
    assert len(reduces) == 1, out
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", reduces[0]), out
    assert "cp.async.bulk.commit_group" in out and "cp.async.bulk.wait_group" in out, out


def test_ptx_only_stops_before_ptxas_and_leaves_nothing_behind(tmp_path):
    """``sm90_check.ptx_only``: inside, the same PTX without a binary, even with a cache
    manager of the user's (a remote one would share the empty binary); after it, every
    Triton knob and environment variable is as before, so the same kernel compiles to a real
    binary; it refuses to nest."""
    code = ("import os\n"
            "from triton import knobs\n"
            "from triton.runtime.cache import FileCacheManager\n"
            "from flashtile.tools.sm90_check import compile_tma_reduce_probe as f, ptx_only\n"
            "class Shared(FileCacheManager):\n"
            "    puts = 0\n"
            "    def put(self, *a, **k):\n"
            "        Shared.puts += 1\n"
            "        return super().put(*a, **k)\n"
            "knobs.cache.manager_class = Shared\n"
            "state = lambda: (dict(os.environ), *(dict(g.__dict__) for g in (knobs.cache, knobs.runtime,\n"
            "                 knobs.compilation, knobs.nvidia)))\n"
            "before = state()\n"
            "with ptx_only():\n"
            "    a = f()\n"
            "    try:\n"
            "        with ptx_only():\n"
            "            pass\n"
            "        nested = 'allowed'\n"
            "    except RuntimeError:\n"
            "        nested = 'refused'\n"
            "print(len(a.cubin), Shared.puts, state() == before, nested)\n"
            "b = f()\n"
            "print(len(b.cubin), a.ptx == b.ptx, Shared.puts > 0, 'Used' in b.ptxas_log)")
    inside, after = (line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()[-2:])
    assert inside == ["0", "0", "True", "refused"], inside
    assert int(after[0]) > 0 and after[1:] == ["True", "True", "True"], after


def test_tma_reduce_rate_kernels_compile(tmp_path):
    """benchmarks/tma_reduce_rate.py's kernel: the TMA variant issues one bulk reduction per
    tile from its NUM_BUF slots (2 x 32 KB of shared memory at 2 slots), the other atomics
    (PTX only: ``sm90_check.ptx_only``)."""
    code = ("from flashtile.tools.sm90_check import compile_tma_reduce_rate as f, ptx_only\n"
            "for t, n in ((True, 1), (True, 2), (True, 3), (False, 1)):\n"
            "    with ptx_only():\n        c = f(t, n)\n"
            "    print(t, n, c.shared, c.ptx.count('cp.reduce.async.bulk.tensor'), c.ptx.count('atom.global'))")
    rows = [line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()]
    got = {(t, int(n)): (int(smem), int(bulk), int(atom)) for t, n, smem, bulk, atom in rows}
    for n in (1, 2, 3):
        smem, bulk, atom = got[("True", n)]
        assert smem >= n * 64 * 128 * 4 and bulk == 1 and atom == 0, got
    assert got[("False", 1)][1] == 0 and got[("False", 1)][2] > 0, got


@pytest.mark.slow(seconds=40)
def test_one_pass_backward_compiles_with_a_reducer_warp(tmp_path):
    """Issue 17's kernel (``backends.sm90.backward_onepass``, the default backward at d64 and
    d128 unless deterministic): dQ tiles go to a reducer warp that issues bulk TMA
    reductions (at least two in the PTX: one per warpgroup's half, the loop peeled); d64
    (128 queries per step, ``Q_ROWS``) and d128 fit (229,888 B) within a spill bound, their
    loops making the fixed tiles' views anew each step (with them hoisted, d128's wgmma
    descriptors spilled 1,292 B). The packed-sequence variant (a work list) fits too, and
    stores a sequence's last dK/dV tile from registers, rows masked (the fixed-length kernel
    stores only by TMA: no st.global); its 64-row steps spill nothing at d64.

    The dQ slots (session 41, H100 runs 218-222): fixed-length calls store them in the
    accumulator's register order (``DQ_NATIVE``, the default), compiled without bank
    conflicts (the kernel's static assert on ``gl.bank_conflicts``) as ``st.shared.v4``
    only, and the reducer adds each half as one unswizzled box: half the reduction sites of
    the 128-byte swizzle at d128 (two boxes per half), which stores ``v2``; packed sequences
    keep the swizzled slots."""
    code = ("from flashtile.tools.sm90_check import compile_backward_onepass as f\n"
            "for d, causal, varlen, q_rows, swizzle in ((64, False, 0, 128, None), (64, True, 0, 128, None),\n"
            "        (128, False, 0, 64, None), (128, False, 0, 64, 128), (128, False, 1, 64, None),\n"
            "        (64, True, 1, 64, None)):\n"
            "    c = f('bf16', d, causal=causal, varlen=bool(varlen), q_rows=q_rows, dq_swizzle=swizzle)\n"
            "    regs, spills = c.registers()\n"
            "    print(d, causal, varlen, q_rows, swizzle, c.shared, regs, spills,\n"
            "          c.ptx.count('cp.reduce.async.bulk.tensor'), c.wgmma, c.ptx.count('st.global'),\n"
            "          c.ptx.count('st.shared.v4.b32'), c.ptx.count('st.shared.v2.b32'))")
    rows = [line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()]
    assert len(rows) == 6, rows
    reduces_at = {}
    for d, causal, varlen, q_rows, swizzle, shared, regs, spills, reduces, wgmma, stores, v4, v2 in rows:
        assert 0 < int(shared) <= SM90_SHARED_LIMIT and int(reduces) >= 2 and wgmma == "True", rows
        assert int(spills) == 0 if (d, q_rows) == ("64", "64") else int(spills) <= 600, rows
        assert (int(stores) > 0) == (varlen == "1"), rows
        native = varlen == "0" and swizzle == "None"
        assert (int(v4) >= 32 and int(v2) <= 2) if native else (int(v4) <= 2 and int(v2) >= 32), rows
        if d == "128" and varlen == "0":
            reduces_at[swizzle] = int(reduces)
    assert reduces_at["None"] * 2 == reduces_at["128"], rows


@pytest.mark.slow(seconds=40)
def test_one_pass_query_split_compiles(tmp_path):
    """The d64 query split (``backward_onepass.Q_SPLIT``, session 51, not the default): S and dP
    as m64n128 products (64 queries x both warpgroups' 128 keys), dQ from dS in registers
    (a wgmma whose A operand is a register vector, which the default kernel never issues),
    within the default's shared memory, without spills (causal: at most 64 bytes, exp2 on
    both sides of the diagonal tiles' branch; P masked after it spilled 1.6 KB), two bulk
    reductions of dQ, no wgmma serialized by ptxas; its deterministic mode (two dQ slots) fits
    as well."""
    code = ("from flashtile.tools.sm90_check import compile_backward_onepass as f\n"
            "for causal, det in ((False, 0), (True, 0), (True, 1)):\n"
            "    for split in (False, True):\n"
            "        c = f('bf16', 64, causal=causal, q_split=split, deterministic=bool(det))\n"
            "        mma = [l.strip() for l in c.ptx.splitlines() if 'wgmma.mma_async' in l]\n"
            "        rs = sum(1 for l in mma if l.split('},', 1)[1].strip().startswith('{'))\n"
            "        print(causal, det, split, c.shared, *c.registers(), sum('m64n128k16' in l for l in mma), rs,\n"
            "              c.ptx.count('cp.reduce.async.bulk.tensor'), int('serialized' in c.ptxas_log),\n"
            "              int('Used' in c.ptxas_log))")
    rows = [line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()]
    assert len(rows) == 6, rows
    # ptxas ran (a fresh cache) and did not serialize any wgmma (the RS one's registers stay put)
    assert all(row[-2:] == ["0", "1"] for row in rows), rows
    got = {(causal, det, split): [int(x) for x in rest[:-2]] for causal, det, split, *rest in rows}
    for causal, det in (("False", "0"), ("True", "0"), ("True", "1")):
        (shared0, _, _, wide0, rs0, _), (shared1, _, spills, wide1, rs1, reduces) = got[causal, det, "False"], \
            got[causal, det, "True"]
        assert shared1 <= shared0 + 64 and shared1 <= SM90_SHARED_LIMIT, rows
        assert spills <= (64 if causal == "True" else 0), rows
        assert wide0 == rs0 == 0 and wide1 >= 8 and rs1 >= 8 and reduces >= 2, rows


def _assert_grouped_compiles(tmp_path, code: str, kernels: tuple[str, ...]):
    """``code`` prints one row per compiled kernel: its key, 0 or 1 (grouped grid), shared
    bytes, registers, spilled bytes, integer divisions in the PTX. Each kernel's grouped
    variant keeps the shared memory (within the sm_90 limit), spills no more than 64 bytes more,
    and adds divisions (its group arithmetic reached the kernel)."""
    rows = [line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()]
    assert len(rows) == 2 * len(kernels), rows
    got = {(key, grouped): (int(shared), int(spills), int(div)) for key, grouped, shared, _, spills, div in rows}
    for key in kernels:
        (shared0, spills0, div0), (shared1, spills1, div1) = got[key, "0"], got[key, "1"]
        assert shared1 == shared0 <= SM90_SHARED_LIMIT and spills1 <= spills0 + 64 and div1 > div0, rows


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=120)
def test_one_pass_pair_groups_compile(tmp_path):
    """The grouped grid order (``KEYS_OUTER``: block-major within groups of ``pair_group``
    pairs, causal GQA's default since session 47) compiles causal at d64 and d128 with the
    shared memory of pair-major, spills no more, and reaches the kernel: its group arithmetic
    adds integer divisions to the PTX."""
    code = ("from flashtile.tools.sm90_check import compile_backward_onepass as f\n"
            "for d, grouped in ((128, 0), (128, 1), (64, 0), (64, 1)):\n"
            "    c = f('bf16', d, causal=True, keys_outer=bool(grouped))\n"
            "    print(d, grouped, c.shared, *c.registers(), c.ptx.count('div.'))")
    _assert_grouped_compiles(tmp_path, code, ("64", "128"))


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=120)
def test_split_pair_groups_compile(tmp_path):
    """The d256 dV and dK kernels' grouped grid (``backward_split.PAIR_GROUP``, causal GQA's
    default since session 48) compiles causal with the shared memory of pair-major, spills no
    more, and reaches the kernels: its group arithmetic adds integer divisions to the PTX."""
    code = ("from flashtile.tools.sm90_check import compile_backward_ws as f\n"
            "for grouped in (0, 1):\n"
            "    for c in f('bf16', 256, causal=True, keys_outer=bool(grouped))[:2]:\n"
            "        print(c.name.split()[0], grouped, c.shared, *c.registers(), c.ptx.count('div.'))")
    _assert_grouped_compiles(tmp_path, code, ("bwd-ws-dv", "bwd-ws-dk"))


@pytest.mark.exhaustive
@pytest.mark.slow(seconds=180)
def test_one_pass_deterministic_reducer_compiles(tmp_path):
    """The one-pass kernel's deterministic mode (an int32 ``Sem``: session 42): the reducer
    polls its turn with an acquire atomic, and passes it with a release atomic only after
    ``cp.async.bulk.wait_group 0`` (its reductions applied in global memory; the plain
    kernel's ``tma.store_wait`` is the ``.read`` form, which waits only for the shared-memory
    reads). The plain kernel holds no atomic and no full wait. All fit, the rotated order
    (``DET_ROTATE``, without causal: session 43) too, and it reaches the kernel: its
    q_rot and ``_rotated_turn`` add integer divisions to the ascending order's PTX (d64 and
    d128: 12 -> 17)."""
    code = ("from flashtile.tools.sm90_check import compile_backward_onepass as f\n"
            "for d, causal, det, rot in ((128, True, 1, 0), (64, False, 1, 0), (64, False, 1, 1), (128, False, 1, 0),\n"
            "                            (128, False, 1, 1), (128, True, 0, 0)):\n"
            "    c = f('bf16', d, causal=causal, deterministic=bool(det), rotate=bool(rot))\n"
            "    full = c.ptx.count('cp.async.bulk.wait_group 0;')\n"
            "    print(d, causal, det, rot, c.shared, full, c.ptx.count('atom.global.gpu.acquire.add'),\n"
            "          c.ptx.count('atom.global.gpu.release.add'), c.ptx.count('atom.'), c.ptx.count('div.'))")
    rows = [line.split() for line in _compile_run(tmp_path, "-c", code).splitlines()]
    assert len(rows) == 6, rows
    divs = {}
    for d, causal, det, rot, shared, full, acquire, release, atoms, div in rows:
        assert 0 < int(shared) <= SM90_SHARED_LIMIT, rows
        if det == "1":
            assert int(full) >= 1 and int(acquire) >= 1 and int(release) >= 1, rows
        else:
            assert int(full) == 0 and int(atoms) == 0, rows
        if causal == "False":
            divs[d, rot] = int(div)
    assert divs["64", "1"] > divs["64", "0"] and divs["128", "1"] > divs["128", "0"], rows


@pytest.mark.parametrize("part, count", [("fit", 5), pytest.param("rest", 16, marks=pytest.mark.exhaustive)])
def test_flex_kernels_compile_and_fit(tmp_path, part, count):
    """Issue 35's kernels with translated mods build sm_90a PTX and fit shared memory: the
    forward, dQ and dK/dV at d64 and d128 with ALiBi + causal and with a relative-position
    table + a document mask (a mod that loads a whole tile: ``flex.tiles``' heavy tiles, which
    fit where the plain ones did not: 362 KB of shared memory at d128); then a learned (L, S)
    bias at d64 and q/k, v head dims (192, 128), (256, 256) with ALiBi + causal,
    compiled with the run-time specialization of lengths and head dims (the H100 refused
    the d192/128 forward at 256 KB and the learned bias's dQ at 240 KB, session 24). To the
    PTX only (``sm90_check.ptx_only``: no ptxas, a third of the time; the GPU tests run it).
    ``make test`` compiles the five that once ran out of shared memory ("fit": the table +
    document mask at d128, which takes the heavy tiles, the learned bias's dQ, the (192, 128)
    forward); the other 16 are exhaustive (the GPU tests build them all)."""
    out = _compile_run(tmp_path, "-m", "flashtile.tools.sm90_check", "--flex", "--flex-part", part, "--ptx-only")
    lines = [line for line in out.splitlines() if line.startswith(("ok  ", "FAIL"))]
    assert len(lines) == count and all(line.startswith("ok  ") for line in lines), out
    assert all("wgmma=True" in line for line in lines), out
    if part == "fit":
        assert sum("relative_bias_score" in line and " d128 " in line for line in lines) == 3, out
        assert sum("flex-fwd bf16 d192-128 " in line for line in lines) == 1, out


def test_flex_part_without_flex_is_refused_by_name(capsys):
    """``--flex-part`` picks a part of the flex compiles: without ``--flex`` it is refused
    before any compile, naming the argument."""
    from flashtile.tools import sm90_check

    with pytest.raises(SystemExit):
        sm90_check.main(["--flex-part", "fit"])
    assert "--flex-part needs --flex" in capsys.readouterr().err


def test_a_bad_regs_match_is_refused_by_name(capsys):
    """``--regs-match`` takes a regular expression: a bad one is refused before any compile,
    naming the argument."""
    from flashtile.tools import sm90_check

    with pytest.raises(SystemExit):
        sm90_check.main(["--regs-match", "("])
    assert "argument --regs-match: not a regular expression" in capsys.readouterr().err

"""The ``flashtile`` command: ``demo``, ``traffic``, ``bench``, ``explain`` and ``check``.

    flashtile demo                         # the lesson's five checked demonstrations
    flashtile traffic --seq 1024 4096      # naive vs tiled HBM traffic per head
    flashtile traffic --plot traffic.png   # the same as a log-log plot (needs matplotlib)
    flashtile bench --quick --pass fwd     # everything after `bench` goes to flashtile.tools.bench

Each subcommand imports what it needs when it runs, so ``flashtile demo`` and
``flashtile traffic`` work with numpy alone and only ``bench`` touches torch.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
from typing import Sequence

from flashtile.public import missing_dependency

DEFAULT_SEQ_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MEASURE_SEQ_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # `traffic --measure`: large enough to pass the L2
MEASURE_HEAD_DIMS = (64, 128)


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1, with an error message that names the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog="flashtile",
        description="FlashAttention you can read: NumPy tile algebra, Triton kernels, traffic model.",
    )
    from flashtile import __version__  # numpy-only package import

    parser.add_argument("--version", action="version", version=f"flashtile {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,traffic,bench,explain,check}")

    sub.add_parser(
        "demo",
        help="run the lesson's demonstrations (NumPy, CPU, a few seconds)",
        description="Tiled vs naive, HBM traffic, +500 logits, the causal invariant, the backward.",
    )

    traffic = sub.add_parser(
        "traffic",
        help="print the naive vs tiled HBM traffic table",
        description="HBM traffic per (batch, head) of naive and tiled attention, from flashtile.traffic.",
    )
    traffic.add_argument(
        "--seq", type=_positive_int, nargs="+", metavar="N",
        help=f"sequence lengths (default: {list(DEFAULT_SEQ_LENGTHS)}; with --measure {list(MEASURE_SEQ_LENGTHS)})",
    )
    traffic.add_argument("--d", type=_positive_int, nargs="+", metavar="D",
                         help="head dims, a table each (default: 64; with --measure 64 128)")
    traffic.add_argument(
        "--dtype-bytes", type=_positive_int, default=4,
        help="bytes per element: 4 float32, 2 fp16/bf16 (default: %(default)s)",
    )
    traffic.add_argument("--br", type=_positive_int, default=64, help="Q tile rows Br (default: %(default)s)")
    traffic.add_argument("--bc", type=_positive_int, default=64, help="K/V tile rows Bc (default: %(default)s)")
    traffic.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    traffic.add_argument("--backward", action="store_true", help="model the backward pass instead of the forward")
    traffic.add_argument("--plot", metavar="FILE.png", help="also write a log-log plot (needs matplotlib)")
    measure = traffic.add_argument_group(
        "measured bytes (GPU)", "--measure runs naive and flashtile attention under Nsight Compute and prints the "
        "DRAM bytes each pass moved beside the model's (flashtile.tools.traffic_measure); without a GPU or ncu it says "
        "so and exits 0. --seq and --d pick the shapes (default here: N 1024..16384, d 64 and 128)")
    measure.add_argument("--measure", action="store_true", help="read the DRAM byte counters (needs a GPU and ncu)")
    measure.add_argument("--heads", type=_positive_int, default=16, help="heads, batch 1 (default: %(default)s)")
    measure.add_argument("--ncu", metavar="PATH", help="the ncu binary (default: FLASHTILE_NCU, then PATH)")
    measure.add_argument("--out", metavar="DIR", help="write the rows (JSON lines) and ncu's CSV here")
    measure.add_argument("--from-csv", metavar="FILE", help="no GPU needed: the table, rows and plot of the "
                         "ncu-traffic.csv an earlier --measure saved (give its --seq/--d/--heads if not the defaults)")
    measure.add_argument("--gpu-name", metavar="NAME", help="with --from-csv: the GPU the CSV was measured on")

    explain = sub.add_parser(
        "explain",
        help="which kernels a call takes, and why (no GPU needed)",
        description="The forward and backward kernels and configs of a described call (flashtile.tools.explain).",
    )
    explain.add_argument("--seqlen-q", type=_positive_int, default=4096)
    explain.add_argument("--seqlen-k", type=_positive_int)
    explain.add_argument("--head-dim", type=_positive_int, default=128)
    explain.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16")
    explain.add_argument("--causal", action="store_true")
    explain.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"))
    explain.add_argument("--softcap", type=float, default=0.0)
    explain.add_argument("--alibi", action="store_true")
    explain.add_argument("--dropout", type=float, default=0.0)
    explain.add_argument("--varlen", action="store_true", help="a packed call (seqlen = the longest sequence)")
    explain.add_argument("--seqused", action="store_true", help="varlen with seqused_q/k or paged keys")
    explain.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    explain.add_argument("--capability", type=int, nargs=2, default=(9, 0), metavar=("MAJOR", "MINOR"))
    explain.add_argument("--deterministic", action="store_true", help="the call asks for bitwise reproducible gradients")
    explain.add_argument("--sink", action="store_true", help="learnable attention sinks (learnable_sink)")
    explain.add_argument("--chunk", type=_positive_int, help="chunked attention (attention_chunk)")
    explain.add_argument("--sdpa-provider", action="store_true",
                         help="the SDPA provider's state and the calls it sent back to PyTorch's own kernels")
    explain.add_argument("--flex-score", choices=("alibi", "softcap", "relative_bias", "bias"),
                         help="a flex_attention call with this ready-made score_mod: its kernels and generated source")
    explain.add_argument("--flex-mask", choices=("causal", "sliding_window", "chunked", "document", "prefix_lm"),
                         help="a flex_attention call with this ready-made mask_mod: its kernels and generated source")

    check = sub.add_parser(
        "check",
        help="does flashtile work here? every API against a float64 reference (GPU if any, else CPU)",
        description="A small matrix of every API family under the accuracy rule, with the machine, the versions "
                    "and the kernels taken (flashtile.tools.check); exit status 1 when a case fails.",
    )
    check.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    check.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), nargs="+",
                       help="default: fp16 and bf16 on a GPU, fp32 on CPU")

    # No options of its own and no -h: every argument after `bench`, -h included, is
    # flashtile.tools.bench's to parse.
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark against torch SDPA and others (GPU; `flashtile bench -h` for options)",
    )
    return parser


def _run_traffic(args: argparse.Namespace) -> int:
    if args.measure:
        from flashtile.tools.traffic_measure import measure

        return measure(args.seq or list(MEASURE_SEQ_LENGTHS), args.d or list(MEASURE_HEAD_DIMS),
                       heads=args.heads, ncu=args.ncu, out_dir=args.out, plot_path=args.plot,
                       from_csv=args.from_csv, gpu_name=args.gpu_name)
    from flashtile import traffic

    args.seq = args.seq or list(DEFAULT_SEQ_LENGTHS)
    args.d = args.d or [64]

    for i, d in enumerate(args.d):
        if i:
            print()
        _model_table(traffic, args, d)
    if args.plot:
        if args.causal or args.backward:
            print("note: the plot shows the full (non-causal) forward pass", file=sys.stderr)
        path = traffic.plot_traffic(
            args.seq, args.plot, d=args.d[0], dtype_bytes=args.dtype_bytes, Br=args.br, Bc=args.bc
        )
        print(f"wrote {path}")
    return 0


def _model_table(traffic: types.ModuleType, args: argparse.Namespace, d: int) -> None:
    table_kwargs = dict(d=d, dtype_bytes=args.dtype_bytes, Br=args.br, Bc=args.bc, causal=args.causal)
    if args.backward:
        if "backward" in inspect.signature(traffic.print_traffic_table).parameters:
            traffic.print_traffic_table(seq_lengths=args.seq, backward=True, **table_kwargs)
        else:
            _print_backward_table(traffic, args.seq, **table_kwargs)
    else:
        traffic.print_traffic_table(seq_lengths=args.seq, **table_kwargs)


def _print_backward_table(traffic: types.ModuleType, seq_lengths: Sequence[int], *, d: int, dtype_bytes: int,
                          Br: int, Bc: int, causal: bool) -> None:
    """Backward-pass counterpart of ``print_traffic_table``, from ``memory_work(backward=True)``."""
    mb = 1e6
    print(f"HBM traffic per head, backward: d={d}, {dtype_bytes} B/element, Br={Br}, Bc={Bc}, "
          f"causal={causal} (MB = 1e6 bytes)")
    print(f"{'N':>7} | {'naive NxN elems':>15} | {'naive MB':>10} | {'flash min MB':>12} | "
          f"{'flash+reread MB':>15} | {'naive/flash':>11}")
    for n in seq_lengths:
        work = traffic.memory_work(n, d, dtype_bytes=dtype_bytes, Br=Br, Bc=Bc, causal=causal, backward=True,
                                   sram_kv_reuse="hbm")  # the "flash+reread" column: every re-read from HBM
        print(f"{n:>7} | {work.naive.nxn_touches:>15,} | {work.naive.hbm_bytes / mb:>10.2f} | "
              f"{work.flash.compulsory_bytes / mb:>12.3f} | {work.flash.hbm_bytes / mb:>15.3f} | "
              f"{work.ratio:>10.1f}x")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashtile`` console script and ``python -m flashtile``.

    Returns the exit status: 0 on success, 1 if a demo check failed, 2 on a usage error
    (including no subcommand), or whatever ``flashtile.tools.bench.main`` returns.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # parse_known_args: the options after `bench` are unknown here and pass through.
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "bench":
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError:
            print(missing_dependency("torch", "flashtile bench"), file=sys.stderr)
            return 2
        from flashtile.tools import bench

        return int(bench.main(rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        try:
            import torch
        except ModuleNotFoundError:
            print(missing_dependency("torch", "flashtile check"), file=sys.stderr)
            return 2
        from flashtile.tools.check import run_check

        dtypes = None if not args.dtype else [
            {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in args.dtype]
        return run_check(args.device, dtypes)
    if args.command == "demo":
        from flashtile.tools.demo import run_demo

        return run_demo()
    if args.command == "explain" and args.sdpa_provider:
        from flashtile.integrations import torch_sdpa

        print(torch_sdpa.report())
        return 0
    if args.command == "explain" and (args.flex_score or args.flex_mask):
        from flashtile.tools.explain import example_mod, explain_flex

        nheads = 16
        seqlen_k = args.seqlen_k or args.seqlen_q
        score = args.flex_score and example_mod(args.flex_score, args.seqlen_q, seqlen_k, nheads)
        mask = args.flex_mask and example_mod(args.flex_mask, args.seqlen_q, seqlen_k, nheads)
        print(explain_flex(score or None, mask or None, device=args.device, capability=tuple(args.capability)))
        return 0
    if args.command == "explain":
        from flashtile.tools.explain import explain

        print(explain(args.seqlen_q, args.seqlen_k, args.head_dim, dtype=args.dtype, causal=args.causal,
                      window=tuple(args.window), softcap=args.softcap, alibi=args.alibi, dropout_p=args.dropout,
                      varlen=args.varlen, seqused=args.seqused, device=args.device,
                      capability=tuple(args.capability), deterministic=args.deterministic, sink=args.sink,
                      chunk=args.chunk or 0))
        return 0
    return _run_traffic(args)


if __name__ == "__main__":
    raise SystemExit(main())

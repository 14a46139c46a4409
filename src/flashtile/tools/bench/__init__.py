"""``flashtile bench``: flashtile against its peers on a GPU, one JSON row per measurement.

    python -m flashtile.tools.bench [options]        # prefill (prefill.py): every impl, fwd/bwd
    python -m flashtile.tools.bench --varlen ...     # packed documents (varlen.py)
    python -m flashtile.tools.bench --decode ...     # KV-cache decode bandwidth (decode.py)
    python -m flashtile.tools.bench --flex ...       # flex_attention vs torch's Flex (flex.py)

``--dry-run`` runs without CUDA (the plan and fake rows); every module's ``-h`` lists
its options. common.py holds what they share.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The benchmark ``argv`` asks for (``--varlen``, ``--decode``, else prefill)."""
    args = sys.argv[1:] if argv is None else argv
    if "--flex" in args:
        from flashtile.tools.bench import flex

        return flex.main(argv)
    if "--decode" in args:
        from flashtile.tools.bench import decode

        return decode.main(argv)
    if "--varlen" in args:
        from flashtile.tools.bench import varlen

        return varlen.main(argv)
    from flashtile.tools.bench import prefill

    return prefill.main(argv)

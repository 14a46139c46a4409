"""The problem every entry point reduces to, and every argument check.

    spec.py      Problem (the scalars: scale, diagonal, window, softcap, dropout,
                 determinism), Varlen (a packed call's metadata), CacheSpec (a kv-cache call)
    validate.py  every check of every entry point (flash, varlen, kvcache, SDPA, parallel):
                 ValueError/TypeError naming the argument, raised before anything runs
    window.py    the window rules: sides that hide no key become -1, applied once by the
                 API and again by every launcher (idempotent)

No kernels and no torch.library here: ``problem.spec`` and ``problem.window`` import no
torch at all.
"""

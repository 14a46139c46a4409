"""The public surface of ``flashtile``: the names served by ``flashtile.api`` (imported on
first use, so that ``import flashtile`` needs numpy alone) and the message a user gets
when one of them is touched without torch or triton installed. No torch here."""

from __future__ import annotations

# Names served by flashtile.api, which imports torch (and triton where available).
API_NAMES = (
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "scaled_dot_product_attention",
    "unpad_input",
    "pad_input",
    "flex_attention",
    "create_block_mask",
    "mods",
)
# Numpy-only submodules loaded on first access: a lazy import keeps `import flashtile`
# working even where one fails to import.
LAZY_SUBMODULES = ("traffic",)


def missing_dependency(module: str, what: str) -> str:
    """The message for ``what`` (a GPU-API name, a command) used without ``module`` installed."""
    return (f"{what} needs {module}, which is not installed: `pip install torch triton` (or "
            f"`pip install 'flashtile[bench]'`); on a machine without a GPU `make test` sets up a CPU stack. "
            f"The NumPy reference (flashtile.reference) and the traffic model work without it.")

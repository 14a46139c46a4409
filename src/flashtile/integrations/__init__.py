"""Integrations with other libraries, each imported only when asked for:

    transformers.py  Hugging Face transformers: ``import flashtile.integrations.transformers``
                     registers ``attn_implementation="flashtile"``
"""

"""flashtile.backends.triton"""

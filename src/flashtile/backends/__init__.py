"""flashtile.backends"""

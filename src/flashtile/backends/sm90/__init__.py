"""flashtile.backends.sm90"""

"""flashtile.backends.twin"""

"""flashtile.runtime"""

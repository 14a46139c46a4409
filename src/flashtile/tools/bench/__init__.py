"""flashtile.tools.bench"""

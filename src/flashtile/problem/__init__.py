"""flashtile.problem"""

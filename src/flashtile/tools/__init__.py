"""flashtile.tools"""

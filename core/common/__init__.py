"""Small helpers every layer may use: warnings aimed at the user's line, quieting libraries.

Imports nothing of layerwise but ``layerwise.errors``.
"""

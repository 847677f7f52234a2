"""Measurements: decode speed against anchors, throughput at equal memory, quality (perplexity, needle,
agreement), the soak past the trained context, and their tables and plots as records.

Drives the engine through the same decode steps as the chat; imports engine and models, never the app.
"""

"""Models: the models.toml registry (aliases, a named error for unknown names), loading (device, dtype,
bitsandbytes, GGUF conversion), memory fit before loading, and random-weight models of real shapes.

Imports the engine (to route a loaded model's attention through it) and nothing above it.
"""

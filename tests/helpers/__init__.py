"""Shared test helpers (tiny random-weight models, prefill inputs without the engine)."""

"""Thin adapters over the public API for the frameworks users already train with; each imported on demand."""

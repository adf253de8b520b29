"""Serving: incremental text (text.py), continuous batching over a SlotEngine (scheduler.py), and an
OpenAI-compatible HTTP server (app.py, cli.py)."""

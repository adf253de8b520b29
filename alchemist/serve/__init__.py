"""Serving: continuous batching over a SlotEngine (scheduler) behind an OpenAI-compatible HTTP server (app)."""

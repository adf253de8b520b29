"""Serving: incremental text (text.py), the continuous-batching scheduler (scheduler.py), and the HTTP server."""

"""Running generated modules: backends, the compiled KV-cached engine, sampling, the public API."""

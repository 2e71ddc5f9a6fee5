"""rnnserve HTTP server: OpenAI-compatible API, Prometheus metrics and the ``rnnserve`` CLI."""

"""Serving beyond one engine: Ray Serve, each replica a vLLM engine with DSpine."""

"""Serving DSpine: `vllm serve` as a subprocess (`openai_server`), vLLM's spec-decode
counters read from an engine or a /metrics page (`metrics`), and Ray Serve, each replica a
vLLM engine with DSpine (`ray_serve`)."""

"""Remote upstreams: OpenAI-compatible engines (vLLM, Ray Serve, SGLang, another localserve) whose
models localserve serves beside its own, through the same routes, lanes and error shapes.

config.py parses the `upstreams` setting; pool.py owns the HTTP client session, each upstream's
health and the lane-ordered slots under its concurrency limit; engine.py is the ModelEngine (a
TextEngine: the upstream templates and tokenizes) a remote model resolves to.
"""

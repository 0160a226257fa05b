"""``xrun serve``: an OpenAI-compatible HTTP server over one engine dir, and its Ray Serve deployment.

    protocol.py    pydantic request models, OpenAI-style errors, streamed text
    scheduler.py   the process's engine set and its one device slot: FIFO queue, cancel, timeout
    app.py         the FastAPI app: routes, SSE streaming, API key, errors
    reply.py       one answer in the OpenAI shapes: stream chunks or the whole body
    metrics.py     Prometheus collectors
    run.py         uvicorn (one process) or Ray Serve (replicas) under ``xrun serve``
    ray_app.py     the Ray Serve application, and ``serve run``'s builder
"""

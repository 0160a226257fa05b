"""``xrun serve``: an OpenAI-compatible HTTP server over one engine dir, and its Ray Serve deployment.

    protocol.py    pydantic request models, OpenAI-style errors, streamed text
    worker.py      what a server runs (ServeConfig) and its engine set, tokenizer and Generator (EngineWorker)
    scheduler.py   the device slot and its queue: FIFO queue, cancel, timeout; the batch loop's thread
    batch_loop.py  the continuous-batching loop on that thread (--max-batch N dirs)
    jobs.py        what the app hands the loops: a request's generations, its cancel event and deadline
    app.py         the FastAPI app: routes, SSE streaming, API key, errors
    reply.py       one answer in the OpenAI shapes: stream chunks or the whole body
    metrics.py     Prometheus collectors
    run.py         uvicorn (one process) or Ray Serve (replicas) under ``xrun serve``
    ray_app.py     the Ray Serve application, and ``serve run``'s builder
"""

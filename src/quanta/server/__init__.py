"""`quanta serve`: an OpenAI-compatible HTTP server over the batched engine, with a web chat page.

``protocol`` turns request bodies into engine settings (every client mistake a 400), ``responses`` writes
OpenAI's response and stream-chunk shapes, ``engine_core`` runs the engine in a process of its own and
``engine_loop`` is this process's side of it, ``completions`` serves the two generation endpoints, ``app``
assembles the routes, and ``http`` runs it under uvicorn.
"""

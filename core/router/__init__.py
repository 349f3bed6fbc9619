"""The push router: OpenAI-compatible front end that sends both legs at once."""

import asyncio

# `kvpush router --loop`, as uvicorn reads it; here, so that the command line can
# offer them without importing aiohttp.
LOOPS = ("auto", "asyncio", "uvloop")


def event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop of `kind`, as uvicorn's --loop reads it: "auto" is uvloop where
    it is installed (vLLM depends on it), else asyncio's. Relaying a stream is a
    read, an edit and a send per token, mostly system calls either way; uvloop's C
    loop takes a little less of the router's CPU per request (docs/benchmarks.md),
    CPU that a router on an engine's host takes from the engines."""
    if kind not in LOOPS:
        raise ValueError(f"unknown event loop {kind!r}; known: {list(LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()

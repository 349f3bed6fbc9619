"""The push router: OpenAI-compatible front end that sends both legs at once."""

# `kvpush router --loop`, as uvicorn reads it; here, so that the command line can
# offer them without importing aiohttp.
LOOPS = ("auto", "asyncio", "uvloop")

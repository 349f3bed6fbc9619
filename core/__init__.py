"""kvpush: push-based KV-cache transfer between prefill and decode engines.

The package imports no torch, no vLLM and no device runtime: those load lazily,
inside the backend or integration that needs them.
"""

if __name__ != "kvpush":
    # This folder is the source of the `kvpush` package; importing it under its folder
    # name would create a second, unrelated copy of every module and class.
    raise ImportError(
        f"the folder 'core' is the package 'kvpush'; use 'import kvpush', not {__name__!r}"
    )

from kvpush.errors import KVPushError

__version__ = "0.1.0"
__all__ = ["KVPushError", "__version__"]

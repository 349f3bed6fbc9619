"""kvpush.backend: everything a device backend is written against, in reading order.

- hookspecs: the hooks, which backends see each, on which thread, and who wins a device;
- records: BackendInfo, Probe and DeviceKV, the answers a backend gives;
- describe: TensorView, torch_view, claimed_device and layout_from_views, which turn a
  worker's KV tensors into the KVLayout NIXL registers;
- staging: the shared hooks of backends that copy KV through host buffers;
- seam: Swappable, the device runtime a test replaces with a fake.

Beside them, the core's side: plugins (the plugin manager that finds backends through
the `kvpush.backends` entry points and routes calls) and host (the built-in DRAM
backend, registered the same way). A backend module imports what it needs from this
package; the wire format (kvpush.layout) lives elsewhere. Errors to raise are in
kvpush.errors: BackendError, ConfigError, BackendNotImplemented.
"""

from kvpush.backend.describe import TensorView, claimed_device, layout_from_views, torch_view
from kvpush.backend.hookspecs import hookimpl
from kvpush.backend.records import BackendInfo, DeviceKV, Probe
from kvpush.backend.seam import Swappable

__all__ = [
    "BackendInfo",
    "DeviceKV",
    "Probe",
    "Swappable",
    "TensorView",
    "claimed_device",
    "hookimpl",
    "layout_from_views",
    "torch_view",
]

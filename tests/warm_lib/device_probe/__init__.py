"""A library that, like torchtitan.tools.utils, asks torch for the device type once, at import:
a script on a CPU patches torch._utils._get_available_device_type (to say "cpu") before it
imports this, and a warm reserve that imported it ahead would see torch's own answer ("cuda")."""
from torch._utils import _get_available_device_type

DEVICE_TYPE = _get_available_device_type() or "cuda"

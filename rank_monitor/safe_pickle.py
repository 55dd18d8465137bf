"""Pickles from peers, read without running any code they name.

`pickle.loads` on bytes from a socket or the job's store runs whatever callable the bytes name
(a `__reduce__` can name `os.system`). Here every global a pickle names (GLOBAL, STACK_GLOBAL,
INST, OBJ, EXT*) goes through `find_class`, which admits only the caller's table of
`(module, name) -> object to use instead`; anything else raises `UnsafePickle` naming it, before
anything is called. Plain data needs no global: dict, list, tuple, str, bytes, int, float, bool,
None (and, from protocol 4 on, set and frozenset) are opcodes. Protocol 2's set and frozenset
(`builtins.set` + a list) are admitted by every table. Persistent ids and out-of-band buffers are
refused by the unpickler itself (none is given).

Used for NVRx's socket protocol (rank_monitor.nvrx_wire) and the flight-recorder dumps the
agents exchange through the store (rank_monitor.flight_recorder.read_trace: hang blame and the
analyzer's copies).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Dict, Mapping, Optional, Tuple

PLAIN: Dict[Tuple[str, str], Any] = {("builtins", "set"): set, ("builtins", "frozenset"): frozenset}


class UnsafePickle(pickle.UnpicklingError):
    """The pickle names a global that is not admitted (nothing was called)."""


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, admitted: Mapping[Tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._admitted = admitted

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._admitted[(module, name)]
        except KeyError:
            raise UnsafePickle(f"it names {module}.{name}, which is not admitted") from None


def loads(data: bytes, admitted: Optional[Mapping[Tuple[str, str], Any]] = None) -> Any:
    """Unpickle `data`, building only plain data and the objects `admitted` maps names to.
    Raises UnsafePickle (a global not admitted) or pickle.UnpicklingError / another Exception
    (the bytes are not a pickle); both mean: nothing from `data` was called."""
    table = dict(PLAIN)
    table.update(admitted or {})
    return _Restricted(bytes(data), table).load()


def loads_plain(data: bytes) -> Any:
    """Unpickle plain data only (torch's flight-recorder traces are dicts, lists and scalars)."""
    return loads(data)


def why_not(exc: BaseException) -> str:
    """One line for an operator: why a pickle was not read."""
    if isinstance(exc, UnsafePickle):
        return str(exc)
    return f"it is not a readable pickle ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else '-'})"

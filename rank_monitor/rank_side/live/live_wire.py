"""Live state on the wire: what a state dict may hold, how it crosses to a peer, and its digest.

One walker (`walk`) decides what a state dict may hold (ADMITTED): None, bool, int, float, complex,
str, bytes, bytearray; dict, OrderedDict (a module's `_metadata` with it), list, tuple, set,
frozenset of those; torch.dtype, torch.device, torch.Size; tensors. Anything else (a function, a
lambda, a user's class, a namedtuple, a numpy array) is refused (`Refused`: where and what) by
the same walker that copies a snapshot at a commit, checks an object's state at its first commit,
and splits a state dict for the wire, so what the first commit admits is exactly what a peer can
receive. The receiver unpickles the skeleton with `_Unpickler`, which resolves only the classes
ADMITTED names: nothing a peer sends runs code.

A state dict goes as a header (the skeleton's length, the number of tensors), its skeleton (every
non-tensor value; each tensor replaced by a `Slot`: its index, its local data's shape and dtype,
whether it lives on the CPU or the accelerator, and for a DTensor its spec: the mesh's device type,
rank grid and dimension names, the placements, the global shape and stride, all plain values,
`dtensor_spec`) pickled and followed by each tensor's byte size, then its tensors in few messages:
those under _DIRECT_BYTES packed, in skeleton order, into chunks of at most
_CHUNK_BYTES (one reused staging buffer: bounded memory), each larger one by itself. Both sides plan
the same messages from the skeleton's shapes and dtypes. A receiver writes each tensor into its
own destination tensor of that path (a DTensor's local shard; shape and dtype must match, else
`LayoutMismatch`: never a silent new tensor), and makes a new one only where it has none (a fresh
optimizer's state, any snapshot object's), on the CPU or its transfer device as the sender had it;
a new one the sender held as a DTensor is handed to the caller's `dtensor(path, data, spec)`
(live_objects.Tracked.place: a DTensor on this rank's own mesh). A receiver that cannot take a state
(a skeleton it cannot read, a tensor that does not fit; the sender's [-1, 0] header: it could not
split its state) reads every message of it first (the sizes say how), then raises: the sender never
waits on it. An error of the wire itself is the caller's to tell apart (PeerLost).

`digest(state)`: a 64-bit digest of a state dict for comparing replicas: its skeleton's canonical
bytes (blake2b) and, per tensor, the sum of its bytes read as int64 words (exact, order-free,
memory-bound: ~60 ms/GB on one CPU core here), combined in tensor order.
"""
from __future__ import annotations

import builtins
import collections
import hashlib
import io
import pickle
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_SCALAR_TYPES = frozenset(_SCALARS)
_MAX_SKELETON = 1 << 30   # a skeleton longer than this is refused as garbage


class Refused(TypeError):
    """A value a peer could not receive (or compare): `path` to it and its type's name."""

    def __init__(self, path: tuple, what: str) -> None:
        self.path, self.what = path, what
        self.name: Optional[str] = None   # the LiveState object it is in (set by live_objects)
        super().__init__(f"{what} at {path_text(path)}")


class LayoutMismatch(RuntimeError):
    """A received or kept tensor whose destination has another shape or dtype."""


class PeerLost(RuntimeError):
    """The wire to a peer failed mid-transfer (the peer is gone, the group broke): not the state's fault."""


class ObjectFailed(RuntimeError):
    """Restoring one object's state failed on this rank (not the wire): `name` and the `error`."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name, self.error = name, error
        super().__init__(f"'{name}': {type(error).__name__}: {error}")


def path_text(path: tuple) -> str:
    return "".join(f"[{k!r}]" for k in path) or "the top level"


def _torch():
    import torch

    return torch


class Slot:
    """A tensor's place in a skeleton: its local data's shape and dtype, and for a DTensor its
    `spec` (dtensor_spec: plain values, no torch class)."""

    __slots__ = ("index", "shape", "dtype", "cpu", "spec")

    def __init__(self, index: int, shape: tuple, dtype, cpu: bool, spec: Optional[tuple] = None) -> None:
        self.index, self.shape, self.dtype, self.cpu, self.spec = index, tuple(shape), dtype, bool(cpu), spec

    def __reduce__(self):
        return Slot, (self.index, self.shape, self.dtype, self.cpu, self.spec)


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and getattr(t, "device_mesh", None) is not None


def local(t):
    """A tensor's own data: a DTensor's local shard, else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


# A DTensor's spec: (mesh device type, the mesh's rank grid (nested tuples), its dimension names or
# None, placements, global shape, global stride), placements each as ("R",), ("S", dim),
# ("SS", dim, split_factor) (_StridedShard) or ("P", reduce_op).
MESH_TYPE, MESH_GRID, MESH_NAMES, PLACEMENTS, SHAPE, STRIDE = range(6)


def mesh_grid(value):
    return tuple(mesh_grid(v) for v in value) if isinstance(value, list) else int(value)


def dtensor_spec(path: tuple, t) -> Optional[tuple]:
    """A DTensor's place on its device mesh in plain values (None for a plain tensor): what a receiver
    needs to rebuild it on its own equal mesh. Refused for a placement it could not rebuild."""
    if not is_dtensor(t):
        return None
    places = []
    for p in t.placements:
        kind = type(p).__name__
        if kind == "Replicate":
            places.append(("R",))
        elif kind == "_StridedShard":
            places.append(("SS", int(p.dim), int(p.split_factor)))
        elif kind == "Shard":
            places.append(("S", int(p.dim)))
        elif kind == "Partial":
            places.append(("P", str(p.reduce_op)))
        else:
            raise Refused(path, f"a DTensor placed as {p!r}")
    mesh = t.device_mesh
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    return (str(mesh.device_type), mesh_grid(mesh.mesh.tolist()), names, tuple(places), tuple(t.shape),
            tuple(t.stride()))


def placements(spec: tuple) -> tuple:
    """The placements of a spec (dtensor_spec) as torch's objects."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    out = []
    for p in spec[PLACEMENTS]:
        if p[0] == "R":
            out.append(Replicate())
        elif p[0] == "S":
            out.append(Shard(int(p[1])))
        elif p[0] == "SS":
            out.append(_StridedShard(int(p[1]), split_factor=int(p[2])))
        elif p[0] == "P":
            out.append(Partial(str(p[1])))
        else:
            raise LayoutMismatch(f"a DTensor placement {p!r} that this version does not know")
    return tuple(out)


def spec_text(spec: tuple) -> str:
    names = spec[MESH_NAMES] or ()
    words = {"R": "R", "S": "S({1})", "SS": "_S({1},{2})", "P": "P({1})"}
    return (f"a DTensor {list(spec[SHAPE])} on a {spec[MESH_TYPE]} mesh {grid_shape(spec[MESH_GRID])}"
            + (f" ({', '.join(names)})" if names else "") + " as "
            + "/".join(words.get(p[0], "?").format(*p) for p in spec[PLACEMENTS]))


def grid_shape(grid) -> list:
    out = []
    while isinstance(grid, tuple):
        out.append(len(grid))
        grid = grid[0] if grid else None
    return out


def walk(value, on_tensor: Callable[[tuple, Any], Any], path: tuple = ()):
    """A copy of `value` (containers rebuilt, scalars shared) with each tensor replaced by
    on_tensor(path, tensor); raises Refused at the first value that is not ADMITTED."""
    torch = _torch()
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        return on_tensor(path, value)
    if kind is dict or kind is collections.OrderedDict:
        out = kind()
        for k, v in value.items():
            if type(k) not in _SCALARS and not (type(k) is tuple and all(type(x) in _SCALARS for x in k)):
                raise Refused(path, f"a key of type {type(k).__name__}")
            out[k] = walk(v, on_tensor, path + (k,))
        meta = getattr(value, "_metadata", None)
        if meta is not None:   # a module's state dict: its version metadata travels with it
            out._metadata = walk(meta, on_tensor, path + ("_metadata",))
        return out
    if kind is list or kind is tuple:
        if _SCALAR_TYPES.issuperset(map(type, value)):   # e.g. Python's RNG state: 625 ints
            return value if kind is tuple else list(value)
        return kind(walk(v, on_tensor, path + (i,)) for i, v in enumerate(value))
    if kind is set or kind is frozenset:
        return kind(walk(v, on_tensor, path + ("{}",)) for v in value)
    if kind is bytearray:
        return bytearray(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return value
    what = "a function" if callable(value) and kind.__name__ in ("function", "lambda", "method",
                                                                  "builtin_function_or_method") \
        else f"a {kind.__module__}.{kind.__qualname__}"
    raise Refused(path, what)


def check(value) -> None:
    """Raise Refused if `value` holds anything a peer could not receive."""
    walk(value, lambda p, t: dtensor_spec(p, t) and t)


def copy(value):
    """A snapshot of `value`: containers rebuilt, tensors cloned (Refused as `walk`)."""
    return walk(value, lambda p, t: t.detach().clone())


def split(value) -> Tuple[Any, list, list]:
    """(skeleton, tensors (local data), paths) of a state dict."""
    tensors: list = []
    paths: list = []

    def slot(path, t):
        data = local(t).detach()
        tensors.append(data)
        paths.append(path)
        return Slot(len(tensors) - 1, data.shape, data.dtype, data.device.type == "cpu", dtensor_spec(path, t))

    return walk(value, slot), tensors, paths


def flat(value, path: tuple = (), out: Optional[dict] = None) -> dict:
    """path -> tensor (the original object: a DTensor stays one) of a state dict."""
    torch = _torch()
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            flat(v, path + (k,), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flat(v, path + (i,), out)
    return out


def fill(skeleton, values: dict):
    """The state dict of a skeleton with each Slot replaced by values[its index]."""
    if isinstance(skeleton, Slot):
        return values[skeleton.index]
    kind = type(skeleton)
    if kind is dict or kind is collections.OrderedDict:
        out = kind()
        for k, v in skeleton.items():
            out[k] = fill(v, values)
        if hasattr(skeleton, "_metadata"):
            out._metadata = skeleton._metadata
        return out
    if kind is list or kind is tuple:
        return kind(fill(v, values) for v in skeleton)
    return skeleton


# ---- the skeleton's bytes: pickled by the sender, read by a restricted unpickler -----------------
class _Unpickler(pickle.Unpickler):
    """Resolves only the classes a skeleton may hold (ADMITTED): nothing a peer sends runs code."""

    def find_class(self, module: str, name: str):
        torch = _torch()
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in ("complex", "set", "frozenset", "bytearray"):
            return getattr(builtins, name)
        if module == "torch":
            if name in ("Size", "device"):
                return getattr(torch, name)
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
        if module == __name__ and name == "Slot":
            return Slot
        raise pickle.UnpicklingError(f"live state from a peer names {module}.{name}, which a state dict may not hold")


def dumps(skeleton, paths: list) -> bytes:
    return pickle.dumps((skeleton, paths), protocol=pickle.HIGHEST_PROTOCOL)


def loads(blob: bytes):
    return _Unpickler(io.BytesIO(blob)).load()


# ---- digest ---------------------------------------------------------------------------------------
def _canon(value, out: list) -> None:
    """Canonical bytes of a skeleton (sets sorted, so that replicas agree whatever their hash seed)."""
    torch = _torch()
    kind = type(value)
    if isinstance(value, Slot):   # a DTensor's spec without its mesh's rank grid (replicas may differ there)
        spec = value.spec and value.spec[:MESH_GRID] + value.spec[MESH_NAMES:]
        out.append(f"S{value.shape}{value.dtype}{spec};".encode())
    elif kind is dict or kind is collections.OrderedDict:
        out.append(b"{")
        for k, v in value.items():
            out.append(repr(k).encode() + b":")
            _canon(v, out)
        out.append(b"}")
    elif kind is list or kind is tuple:
        out.append(b"[" if kind is list else b"(")
        for v in value:
            _canon(v, out)
        out.append(b"]")
    elif kind is set or kind is frozenset:
        out.append(b"<" + b",".join(sorted(repr(v).encode() for v in value)) + b">")
    elif kind is float:
        out.append(struct.pack("<d", value))
    elif isinstance(value, (torch.dtype, torch.device, torch.Size)) or kind in _SCALARS or kind is bytearray:
        out.append(kind.__name__.encode() + repr(value).encode() + b";")
    else:
        out.append(repr(value).encode())


_MASK = (1 << 64) - 1


def _word_sums(t):
    """(sum of t's bytes as int64 words, sum of its trailing bytes), as 0-dim int64 tensors on its device."""
    torch = _torch()
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    head = b[:whole]
    try:
        words = head.view(torch.int64)
    except RuntimeError:   # not 8-byte aligned in its storage
        words = head.clone().view(torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=b.device)
    return (words.sum() if whole else zero), (b[whole:].to(torch.int64).sum() if whole < b.numel() else zero)


def digest(state) -> Tuple[int, int]:
    """(digest of a state dict as a signed 64-bit int, bytes of tensor data read)."""
    skeleton, tensors, _ = split(state)
    parts: list = []
    _canon(skeleton, parts)
    acc = int.from_bytes(hashlib.blake2b(b"".join(parts), digest_size=8).digest(), "little")
    nbytes = 0
    by_device: Dict[Any, List[Tuple[int, Any]]] = collections.defaultdict(list)
    for i, t in enumerate(tensors):
        if t.numel():
            by_device[t.device].append((i, _word_sums(t)))
            nbytes += t.numel() * t.element_size()
    sums: Dict[int, Tuple[int, int]] = {}
    torch = _torch()
    for entries in by_device.values():
        values = torch.stack([s for _, pair in entries for s in pair]).tolist()   # one sync per device
        for k, (i, _) in enumerate(entries):
            sums[i] = (values[2 * k], values[2 * k + 1])
    for i in sorted(sums):
        whole, tail = sums[i]
        acc = (acc * 0x100000001B3 + (whole & _MASK) + 0x9E3779B97F4A7C15 * ((tail & _MASK) + i + 1)) & _MASK
    return acc - (1 << 64) if acc >> 63 else acc, nbytes


def digest64(*parts) -> int:
    """A signed 64-bit digest of `parts` (their repr): identities and layouts in the step exchange."""
    raw = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


# ---- tensors over the wire ------------------------------------------------------------------------
_CHUNK_BYTES = 16 << 20    # the most a staging buffer holds (one, reused: bounded memory, pages touched once)
_DIRECT_BYTES = 1 << 20    # a tensor at least this big (or than _CHUNK_BYTES) is sent by itself
_ALIGN = 64


def _plan(sizes: List[int]) -> Tuple[List[List[Tuple[int, int]]], List[int], List[int]]:
    """The messages for tensors of `sizes` bytes: (chunks, each a list of (tensor index, byte
    offset); each chunk's length; the indices of the tensors sent by themselves). 0-byte tensors
    are in neither."""
    cap = max(1, _CHUNK_BYTES)
    alone = min(_DIRECT_BYTES, cap)
    chunks: List[List[Tuple[int, int]]] = []
    lengths: List[int] = []
    direct: List[int] = []
    used = cap + 1   # no chunk open
    for i, n in enumerate(sizes):
        if n <= 0:
            continue
        if n >= alone:
            direct.append(i)
            continue
        at = -(-used // _ALIGN) * _ALIGN
        if at + n > cap:
            chunks.append([])
            lengths.append(0)
            at = 0
        chunks[-1].append((i, at))
        used = lengths[-1] = at + n
    return chunks, lengths, direct


def _packed(buf, at: int, t):
    """The bytes of `buf` from `at` seen as a tensor of t's shape and dtype."""
    return buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def _send_tensors(tensors: list, device, send) -> None:
    torch = _torch()
    chunks, lengths, direct = _plan([t.numel() * t.element_size() for t in tensors])
    if chunks:
        buf = torch.empty(max(lengths), dtype=torch.uint8, device=device)
        for chunk, length in zip(chunks, lengths):
            for i, at in chunk:
                _packed(buf, at, tensors[i]).copy_(tensors[i])
            send(buf[:length])
    for i in direct:
        t = tensors[i]
        send(t if t.device == device and t.is_contiguous() else t.to(device).contiguous())


def _recv_tensors(dests: list, device, recv) -> None:
    torch = _torch()
    chunks, lengths, direct = _plan([d.numel() * d.element_size() for d in dests])
    if chunks:
        buf = torch.empty(max(lengths), dtype=torch.uint8, device=device)
        for chunk, length in zip(chunks, lengths):
            recv(buf[:length])
            for i, at in chunk:
                dests[i].copy_(_packed(buf, at, dests[i]))
    for i in direct:
        d = dests[i]
        if d.device == device and d.is_contiguous():
            recv(d)
        else:   # one tensor's worth of staging (a CPU destination on NCCL, a non-contiguous one)
            staged = torch.empty(d.shape, dtype=d.dtype, device=device)
            recv(staged)
            d.copy_(staged)


def send_state(state, device, send) -> int:
    """One state dict to a peer: a header (the skeleton's length, the number of tensors), the
    skeleton (pickled) followed by each tensor's byte size, then the tensors. `send(tensor)` is the
    wire. -> bytes sent."""
    torch = _torch()
    try:
        skeleton, tensors, paths = split(state)
        blob = dumps(skeleton, paths)
    except Exception:
        send(torch.tensor([-1, 0], dtype=torch.int64, device=device))   # the receiver raises too, and waits no more
        raise
    sizes = [t.numel() * t.element_size() for t in tensors]
    send(torch.tensor([len(blob), len(sizes)], dtype=torch.int64, device=device))
    send(torch.frombuffer(bytearray(blob + struct.pack(f"<{len(sizes)}q", *sizes)), dtype=torch.uint8).to(device))
    _send_tensors(tensors, device, send)
    return len(blob) + sum(sizes)


def _destination(own, slot: Slot, path: tuple):
    """The tensor a received or kept tensor of `slot` lands in: its own (local data), else None."""
    if own is None:
        return None
    dest = local(own)
    if tuple(dest.shape) != slot.shape or dest.dtype != slot.dtype:
        raise LayoutMismatch(f"{path_text(path)}: {slot.dtype} {list(slot.shape)} does not fit this rank's "
                             f"{dest.dtype} {list(dest.shape)}")
    return dest


def _drain(sizes: List[int], device, recv) -> None:
    """Receive and drop the tensor messages of `sizes` bytes (the sender's plan): a receiver that
    cannot take a state still reads all of it, so the sender never waits on it."""
    torch = _torch()
    chunks, lengths, direct = _plan(sizes)
    if chunks:
        buf = torch.empty(max(lengths), dtype=torch.uint8, device=device)
        for length in lengths:
            recv(buf[:length])
    for i in direct:
        recv(torch.empty(sizes[i], dtype=torch.uint8, device=device))


def recv_state(dests: dict, device, recv, dtensor: Optional[Callable[[tuple, Any, tuple], Any]] = None
               ) -> Tuple[Any, int]:
    """What send_state sent, each tensor written into dests[path] (this rank's own tensor of that
    path) or, where it has none, into a new tensor on the CPU or `device` as the sender had it; a
    new tensor that the sender had as a DTensor becomes dtensor(path, local data, spec) (the
    receiver's own DTensor on its mesh: live_objects.Tracked.place). `recv(tensor)` is the wire.
    A skeleton that cannot be read or a tensor that does not fit raises (LayoutMismatch,
    UnpicklingError) only once every message of the state has been received.
    -> (the state dict, bytes received)."""
    torch = _torch()
    head = torch.empty(2, dtype=torch.int64, device=device)
    recv(head)
    n, count = (int(v) for v in head.tolist())
    if n == -1:
        raise LayoutMismatch("the sender could not send its state (it says why)")
    if not 0 < n <= _MAX_SKELETON or not 0 <= count <= _MAX_SKELETON // 8:
        raise pickle.UnpicklingError(f"a peer announced a live-state skeleton of {n} bytes and {count} tensors")
    raw = torch.empty(n + 8 * count, dtype=torch.uint8, device=device)
    recv(raw)
    data = raw.cpu().numpy().tobytes()
    sizes = list(struct.unpack(f"<{count}q", data[n:]))
    if any(size < 0 for size in sizes):
        raise pickle.UnpicklingError("a peer announced a live-state tensor of negative size")
    targets, values, slots, paths = [], {}, [], []
    try:
        skeleton, paths = loads(data[:n])
        walk_slots(skeleton, slots.append)
        slots.sort(key=lambda s: s.index)
        if [s.index for s in slots] != list(range(count)) or len(paths) != count:
            raise pickle.UnpicklingError(f"a peer's live-state skeleton holds {len(slots)} tensors, it announced "
                                         f"{count}")
        for slot in slots:
            own = dests.get(paths[slot.index])
            dest = _destination(own, slot, paths[slot.index])
            if dest is None:
                dest = torch.empty(slot.shape, dtype=slot.dtype, device="cpu" if slot.cpu else device)
            if dest.numel() * dest.element_size() != sizes[slot.index]:
                raise pickle.UnpicklingError(f"a peer's live-state skeleton says {list(slot.shape)} {slot.dtype} at "
                                             f"{path_text(paths[slot.index])}, its plan {sizes[slot.index]} bytes")
            targets.append(dest)
            values[slot.index] = own if own is not None else dest
    except Exception:
        _drain(sizes, device, recv)
        raise
    _recv_tensors(targets, device, recv)
    if dtensor is not None:
        for slot in slots:
            if slot.spec is not None and values[slot.index] is targets[slot.index]:
                values[slot.index] = dtensor(paths[slot.index], targets[slot.index], slot.spec)
    return fill(skeleton, values), n + sum(sizes)


def walk_slots(skeleton, visit) -> None:
    if isinstance(skeleton, Slot):
        visit(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            walk_slots(v, visit)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            walk_slots(v, visit)


def move_state(committed, dests: dict):
    """A kept rank: its committed state into this call's objects' own tensors (copied in place,
    where it has one of that path), else the committed tensor itself (moved: no copy, it stays on
    its own device). -> the state dict to load."""
    def place(path, t):
        own = dests.get(path)
        data = local(t).detach()
        dest = _destination(own, Slot(0, data.shape, data.dtype, True), path)
        if dest is None:
            return t
        if dest.data_ptr() != data.data_ptr():
            dest.copy_(data)
        return own

    return walk(committed, place)

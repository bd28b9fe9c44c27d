"""A small safetensors writer and reader (no dependency beyond torch).

File layout: an 8-byte little-endian header length n, n bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the raw little-endian
bytes of every tensor, back to back, in header order.
"""
import json
import struct

import torch

from . import files

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save(path, tensors):
    """Writes {name: tensor} to `path`; tensors are stored contiguous, in the given order."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in _NAMES:
            raise ValueError(f"{path}: {name}: dtype {t.dtype} is not F64, F32 or I64")
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # pad the header so the data starts 8-byte aligned
    # whole or not at all, never through a link (files.py)
    files.write_atomically(path, [struct.pack("<Q", len(head)), head, *blobs])


def load(path):
    """Reads a safetensors file into {name: tensor}, in header order."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        begin, end = h["data_offsets"]
        dtype = _DTYPES[h["dtype"]]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin \
            else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(h["shape"]).clone()
    return out

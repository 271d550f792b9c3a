"""Reads a safetensors file the way any PyTorch user can without extra packages (the format is a
u64 header length, a JSON header, raw little-endian data), checks it against the format's rules,
and prints one line per tensor: name, shape, sum and the first value, for test_checkpoint to compare.

Usage: /usr/bin/python3 tests/load_safetensors.py FILE [--write-back OUT]

--write-back OUT also writes OUT with this script's own safetensors writer (json.dumps spacing,
tensors in reverse name order, header space-padded to 8 bytes): every tensor negated, metadata
{"written_by": "load_safetensors.py"} added to FILE's. So the C++ reader is checked on a file it
did not write. (Debian has no `safetensors` Python package; none is needed.)
"""
import json
import struct
import sys

import torch


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len % 8 == 0, "header not 8-byte aligned"
    header = json.loads(data[8:8 + header_len])
    body = data[8 + header_len:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "F32", entry
        begin, end = entry["data_offsets"]
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.float32).reshape(entry["shape"])
        tensors[name] = t
    return tensors, header.get("__metadata__", {})


def write(path, tensors, metadata):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors, reverse=True):
        blob = tensors[name].contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = metadata
    h = json.dumps(header).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    args = sys.argv[1:]
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--write-back"):
        sys.exit("usage: load_safetensors.py FILE [--write-back OUT]")
    tensors, meta = load(args[0])
    print("metadata", json.dumps(meta, sort_keys=True))
    for name in sorted(tensors):
        t = tensors[name].double()
        shape = ",".join(str(d) for d in tensors[name].shape)
        first = t.flatten()[0].item() if t.numel() else 0.0
        print(f"{name} [{shape}] {t.sum().item():.9e} {first:.9e}")
    if len(args) == 3:
        write(args[2], {name: -t for name, t in tensors.items()}, dict(meta, written_by="load_safetensors.py"))


if __name__ == "__main__":
    main()

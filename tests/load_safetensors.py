"""Reads a safetensors file the way any PyTorch user can without extra packages (the format is a
u64 header length, a JSON header, raw little-endian data), checks it against the format's rules,
and prints one line per tensor: name, shape, sum and the first value, for test_checkpoint to compare.

Usage: /usr/bin/python3 tests/load_safetensors.py FILE
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


def main():
    tensors, meta = load(sys.argv[1])
    print("metadata", json.dumps(meta, sort_keys=True))
    for name in sorted(tensors):
        t = tensors[name].double()
        shape = ",".join(str(d) for d in tensors[name].shape)
        first = t.flatten()[0].item() if t.numel() else 0.0
        print(f"{name} [{shape}] {t.sum().item():.9e} {first:.9e}")


if __name__ == "__main__":
    main()

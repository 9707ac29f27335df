#!/usr/bin/env python3
"""Writes a copy of a GGUF model that keeps only its first N transformer
blocks (the embeddings, the final norm and the output head unchanged), for
checks that need the real weights but cannot carry the whole file (a device
run carries at most 64 MiB). The result is a smaller, worse model; it is used
only to compare two backends on the same weights, never for quality.

Usage: scripts/gguf-truncate.py IN.gguf OUT.gguf N
Standard library only. Tensor data are copied byte for byte; the
`<arch>.block_count` entry is set to N and the tensor offsets recomputed at
the file's alignment.
"""
import os
import struct
import sys

SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Reader:
    def __init__(self, data):
        self.d, self.p = data, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.d, self.p)
        self.p += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = self.d[self.p:self.p + n]
        self.p += n
        return s.decode("utf-8")

    def value(self, t):
        if t in SCALAR:
            return self.take(SCALAR[t])
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("I"), self.take("Q")
            return (et, [self.value(et) for _ in range(n)])
        raise ValueError(f"unknown GGUF value type {t}")


def put_string(out, s):
    b = s.encode("utf-8")
    out += struct.pack("<Q", len(b)) + b


def put_value(out, t, v):
    if t in SCALAR:
        out += struct.pack("<" + SCALAR[t], v)
    elif t == 8:
        put_string(out, v)
    else:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for x in items:
            put_value(out, et, x)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = open(src, "rb").read()
    r = Reader(data)
    if data[:4] != b"GGUF":
        sys.exit(f"{src}: not a GGUF file")
    r.p = 4
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    kvs = []
    for _ in range(n_kv):
        k = r.string()
        t = r.take("I")
        kvs.append((k, t, r.value(t)))
    arch = next(v for k, _, v in kvs if k == "general.architecture")
    align = next((v for k, _, v in kvs if k == "general.alignment"), 32)
    blocks = next(v for k, _, v in kvs if k == f"{arch}.block_count")
    if not 0 < keep <= blocks:
        sys.exit(f"keep {keep} blocks: the model has {blocks}")
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("Q") for _ in range(r.take("I"))]
        tensors.append((name, dims, r.take("I"), r.take("Q")))
    base = (r.p + align - 1) // align * align
    ends = sorted(off for *_, off in tensors) + [len(data) - base]
    size = {off: ends[ends.index(off) + 1] - off for *_, off in tensors}

    def kept(name):
        if not name.startswith("blk."):
            return True
        return int(name.split(".")[1]) < keep

    tensors = [t for t in tensors if kept(t[0])]
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, t, v in kvs:
        put_string(out, k)
        out += struct.pack("<I", t)
        put_value(out, t, keep if k == f"{arch}.block_count" else v)
    off, placed = 0, []
    for name, dims, t, old in tensors:
        put_string(out, name)
        out += struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", x) for x in dims)
        out += struct.pack("<IQ", t, off)
        placed.append((old, off))
        off = (off + size[old] + align - 1) // align * align
    out += bytes((-len(out)) % align)
    start = len(out)
    for old, new in placed:
        out += bytes(start + new - len(out))
        out += data[base + old:base + old + size[old]]
    with open(dst + ".tmp", "wb") as f:
        f.write(out)
    os.replace(dst + ".tmp", dst)
    print(f"{dst}: {keep} of {blocks} blocks, {len(tensors)} tensors, {len(out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

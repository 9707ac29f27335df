#!/usr/bin/env python3
"""Extract Jane Austen's novels from r-cran-janeaustenr's Rdata.rdb.

The file is a concatenation of blocks [u32 big-endian uncompressed length][zlib stream];
each stream is an R XDR-serialized character vector (one novel, one line per
element). Writes OUT/<title>.txt (e.g. pride_and_prejudice.txt). Usage: austen_rdb.py Rdata.rdb OUT
"""
import os, struct, sys, zlib

def read_strsxp(b):
    """Parses an XDR serialization ('X\\n' header) holding a STRSXP; returns its strings."""
    if b[:2] != b"X\n":
        return None
    pos = 2
    version = struct.unpack(">i", b[pos:pos + 4])[0]; pos += 12  # version, writer, min reader
    if version == 3:
        n = struct.unpack(">i", b[pos:pos + 4])[0]; pos += 4 + n    # native encoding
    flags = struct.unpack(">i", b[pos:pos + 4])[0]; pos += 4
    if flags & 0xFF != 16:  # STRSXP
        return None
    length = struct.unpack(">i", b[pos:pos + 4])[0]; pos += 4
    out = []
    for _ in range(length):
        cflags, n = struct.unpack(">ii", b[pos:pos + 8]); pos += 8
        if cflags & 0xFF != 9:  # CHARSXP
            raise ValueError("unexpected element type %d" % (cflags & 0xFF))
        if n == -1:
            out.append("")
            continue
        out.append(b[pos:pos + n].decode("utf-8", "replace")); pos += n
    return out

def main(rdb, outdir):
    data = open(rdb, "rb").read()
    pos, k = 0, 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        d = zlib.decompressobj()
        try:
            raw = d.decompress(data[pos + 4:])
        except zlib.error as e:
            sys.exit("austen_rdb: corrupt block at offset %d: %s" % (pos, e))
        if len(raw) != n:
            sys.exit("austen_rdb: block at offset %d inflates to %d bytes, header says %d" % (pos, len(raw), n))
        pos = len(data) - len(d.unused_data)
        lines = read_strsxp(raw)
        if lines and len(lines) > 1000:
            title = next((l.strip() for l in lines if l.strip()), "novel %d" % k)
            slug = "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_") or "novel_%d" % k
            with open(os.path.join(outdir, slug + ".txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
            k += 1
    if k == 0:
        sys.exit("austen_rdb: no novels found in " + rdb)
    print("austen_rdb: wrote %d novels" % k, file=sys.stderr)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

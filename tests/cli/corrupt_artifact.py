#!/usr/bin/env python3
"""Writes a damaged copy of a .kiln artifact for the CLI tests: corrupt_artifact.py IN OUT MODE.

MODE: truncate (drop the last 100 bytes), flip (flip one byte inside the plan section),
magic (overwrite the magic), version (format version 2).
"""
import struct
import sys


def main(src, dst, mode):
    data = bytearray(open(src, "rb").read())
    if mode == "truncate":
        data = data[:-100]
    elif mode == "flip":
        count, table = struct.unpack_from("<IQ", data, 12)
        for i in range(count):
            _kind, _flags, offset, size, _sum, name = struct.unpack_from("<IIQQQ64s", data, table + 96 * i)
            if name.rstrip(b"\0") == b"plan":
                data[offset + size // 2] ^= 0x01
                break
        else:
            sys.exit("no plan section in " + src)
    elif mode == "magic":
        data[0:8] = b"NOTKILN\0"
    elif mode == "version":
        struct.pack_into("<I", data, 8, 2)
    else:
        sys.exit("unknown mode " + mode)
    open(dst, "wb").write(data)


if __name__ == "__main__":
    main(*sys.argv[1:4])

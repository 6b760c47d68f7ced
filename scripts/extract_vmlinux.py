"""Extract the ELF vmlinux from a bzImage, if it has a PVH entry note.

QEMU boots such an ELF directly (-kernel vmlinux): under TCG that skips SeaBIOS and
the in-guest decompression. Usage: extract_vmlinux.py BZIMAGE OUT; exit 1 if none."""

import lzma
import os
import struct
import sys
import zlib


def payload(data: bytes) -> bytes | None:
    for magic, kind in ((b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b\x08", "gz")):
        i = data.find(magic)
        while i >= 0:
            try:
                if kind == "xz":
                    out = lzma.LZMADecompressor().decompress(data[i:])
                else:
                    out = zlib.decompressobj(31).decompress(data[i:])
                if out[:4] == b"\x7fELF":
                    return out
            except (lzma.LZMAError, zlib.error, EOFError):
                pass
            i = data.find(magic, i + 1)
    return None


def has_pvh_note(elf: bytes) -> bool:
    """A Xen note XEN_ELFNOTE_PHYS32_ENTRY (18) in a PT_NOTE segment."""
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for k in range(phnum):
        p_type, _, p_off, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, phoff + k * phentsize)
        if p_type != 4:
            continue
        o, end = p_off, p_off + p_filesz
        while o + 12 <= end:
            nsz, dsz, typ = struct.unpack_from("<III", elf, o)
            if elf[o + 12:o + 12 + nsz].rstrip(b"\0") == b"Xen" and typ == 18:
                return True
            o += 12 + ((nsz + 3) & ~3) + ((dsz + 3) & ~3)
    return False


def main() -> int:
    elf = payload(open(sys.argv[1], "rb").read())
    if elf is None or not has_pvh_note(elf):
        return 1
    with open(sys.argv[2] + ".tmp", "wb") as f:
        f.write(elf)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Checks for `moe report` pages, run by tests/test_report.cpp with Debian's python3 (standard library only).

  report_check.py charts PAGE.html   parse the page as XML (well-formed or an error) and print, as JSON,
                                     the data-chart of every <figure> and the data-missing of every note
  report_check.py png PNG            decode a screenshot (8-bit RGB/RGBA, non-interlaced, as Chromium
                                     writes) and print, as JSON, its size, the share of pixels that are
                                     not white and how many distinct colours it has
  report_check.py crop PNG OUT Y0 Y1 rows Y0..Y1 of PNG into OUT (to look at a tall screenshot)
"""
import json
import struct
import sys
import xml.etree.ElementTree as ET
import zlib

XHTML = "{http://www.w3.org/1999/xhtml}"


def charts(path):
    root = ET.parse(path).getroot()  # raises ParseError on a page that is not well-formed
    figures = [f.get("data-chart") for f in root.iter(XHTML + "figure")]
    missing = [p.get("data-missing") for p in root.iter() if p.get("data-missing")]
    ids = [e.get("id") for e in root.iter() if e.get("id")]
    svgs = len(list(root.iter("{http://www.w3.org/2000/svg}svg")))
    scripts = len(list(root.iter(XHTML + "script")))
    notes = ["".join(e.itertext()) for e in root.iter() if e.get("id") == "missing-fields"]
    print(json.dumps({"charts": figures, "missing": missing, "duplicate_ids": len(ids) - len(set(ids)),
                      "svgs": svgs, "scripts": scripts, "missing_note": notes[0] if notes else ""}))


def read_png(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or ctype not in (2, 6) or interlace:
                raise SystemExit(f"{path}: only 8-bit RGB/RGBA non-interlaced PNGs are read here")
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def png_stats(path):
    width, height, bpp, rows = read_png(path)
    non_white, colours = 0, set()
    for line in rows:
        for x in range(0, width * bpp, bpp * 2):  # every other pixel: plenty for a share
            px = line[x:x + 3]
            colours.add(px)
            if px != b"\xff\xff\xff":
                non_white += 1
    sampled = height * ((width + 1) // 2)
    print(json.dumps({"width": width, "height": height, "non_white": non_white / sampled, "colours": len(colours)}))


def crop(path, out, y0, y1):
    width, height, bpp, rows = read_png(path)
    y1 = min(y1, height)
    raw = b"".join(b"\x00" + rows[y][:width * bpp] for y in range(y0, y1))
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, y1 - y0, 8, 2 if bpp == 3 else 6, 0, 0, 0)
    open(out, "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) +
                          chunk(b"IEND", b""))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "charts":
        charts(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "png":
        png_stats(sys.argv[2])
    elif len(sys.argv) == 6 and sys.argv[1] == "crop":
        crop(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(__doc__)

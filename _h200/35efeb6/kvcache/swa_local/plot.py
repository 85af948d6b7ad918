"""A line chart as a PNG, with no plotting library: hit rate against TTL for ``kvcache swa
simulate --plot``.

A small RGB canvas, straight lines, a 5x7 bitmap font for the labels, and a
PNG encoder (zlib, the standard library). Enough for one chart; not a
plotting package.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Canvas", "hit_rate_chart", "png_bytes"]

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (20, 20, 20)
GRID: RGB = (225, 225, 225)
MARK: RGB = (150, 150, 150)
SERIES: tuple[RGB, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))

#: 5x7 glyphs, one string of 5 pixels per row ('#' on).
_GLYPHS: dict[str, tuple[str, ...]] = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    "a": (".....", ".....", ".###.", "....#", ".####", "#...#", ".####"),
    "b": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."),
    "c": (".....", ".....", ".###.", "#....", "#....", "#...#", ".###."),
    "d": ("....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"),
    "e": (".....", ".....", ".###.", "#...#", "#####", "#....", ".###."),
    "f": ("..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."),
    "g": (".....", ".####", "#...#", "#...#", ".####", "....#", ".###."),
    "h": ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "i": ("..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."),
    "k": ("#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."),
    "l": (".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "m": (".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#"),
    "n": (".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    "o": (".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."),
    "p": (".....", ".....", "####.", "#...#", "####.", "#....", "#...."),
    "r": (".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."),
    "s": (".....", ".....", ".####", "#....", ".###.", "....#", "####."),
    "t": (".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."),
    "u": (".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"),
    "v": (".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "w": (".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."),
    "x": (".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"),
    "y": (".....", ".....", "#...#", "#...#", ".####", "....#", ".###."),
    "%": ("##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"),
    "(": ("..#..", ".#...", "#....", "#....", "#....", ".#...", "..#.."),
    ")": ("..#..", "...#.", "....#", "....#", "....#", "...#.", "..#.."),
    ".": (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    "-": (".....", ".....", ".....", "#####", ".....", ".....", "....."),
    ":": (".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."),
    "/": (".....", "....#", "...#.", "..#..", ".#...", "#....", "....."),
    ",": (".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."),
}


def _glyph(ch: str) -> tuple[str, ...]:
    return _GLYPHS.get(ch, ("." * 5,) * 7)


class Canvas:
    """An RGB raster with lines, rectangles and text."""

    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        """Color one pixel (outside the canvas: ignored)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> RGB:
        """The color of one pixel."""
        i = 3 * (y * self.width + x)
        r, g, b = self.pixels[i : i + 3]
        return (r, g, b)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        for y in range(min(y0, y1), max(y0, y1) + 1):
            for x in range(min(x0, x1), max(x0, x1) + 1):
                self.set(x, y, color)

    def line(
        self, x0: int, y0: int, x1: int, y1: int, color: RGB, *, width: int = 1, dash: int = 0
    ) -> None:
        """A straight line (Bresenham), ``width`` pixels thick, dashed every ``dash`` pixels."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, step = dx + dy, 0
        while True:
            if not dash or (step // dash) % 2 == 0:
                half = width // 2
                self.rect(x0 - half, y0 - half, x0 - half + width - 1, y0 - half + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            step += 1
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, value: str, color: RGB = BLACK, *, scale: int = 2) -> int:
        """Draw ``value`` (lower case, digits, a few signs) from its top left; its width."""
        for i, ch in enumerate(value.lower()):
            for row, bits in enumerate(_glyph(ch)):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        px, py = x + (i * 6 + col) * scale, y + row * scale
                        self.rect(px, py, px + scale - 1, py + scale - 1, color)
        return len(value) * 6 * scale

    def png(self) -> bytes:
        """The canvas as a PNG file."""
        return png_bytes(self.width, self.height, bytes(self.pixels))


def png_bytes(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (rows top to bottom, 3 bytes a pixel)."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"{len(rgb)} bytes for a {width}x{height} RGB image")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def hit_rate_chart(
    ttls_s: Sequence[float],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    title: str,
    mark_ttl_s: float | None = None,
    path: Path | None = None,
    width: int = 760,
    height: int = 460,
) -> Canvas:
    """Hit rates (0..1) against TTLs (log scale), one line per series; saved when ``path``."""
    if len(ttls_s) < 2 or any(t <= 0 for t in ttls_s):
        raise ValueError("need two or more positive TTLs")
    left, right, top, bottom = 80, 24, 56, 80
    canvas = Canvas(width, height)
    x_lo, x_hi = math.log10(min(ttls_s)), math.log10(max(ttls_s))

    def px(ttl: float) -> int:
        return left + round((math.log10(ttl) - x_lo) / (x_hi - x_lo) * (width - left - right))

    def py(rate: float) -> int:
        return top + round((1 - rate) * (height - top - bottom))

    for pct in range(0, 101, 20):
        y = py(pct / 100)
        canvas.line(left, y, width - right, y, GRID)
        label = f"{pct}"
        canvas.text(left - 12 - len(label) * 12, y - 7, label)
    for ttl in ttls_s:
        x = px(ttl)
        canvas.line(x, height - bottom, x, height - bottom + 6, BLACK)
        label = _duration(ttl)
        canvas.text(x - len(label) * 6, height - bottom + 12, label)
    canvas.line(left, top, left, height - bottom, BLACK)
    canvas.line(left, height - bottom, width - right, height - bottom, BLACK)
    if mark_ttl_s is not None and min(ttls_s) <= mark_ttl_s <= max(ttls_s):
        canvas.line(px(mark_ttl_s), top, px(mark_ttl_s), height - bottom, MARK, dash=6)
    for (_name, rates), color in zip(series, SERIES, strict=False):
        points = [(px(t), py(max(0.0, min(1.0, r)))) for t, r in zip(ttls_s, rates, strict=True)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, color, width=3)
        for x, y in points:
            canvas.rect(x - 3, y - 3, x + 3, y + 3, color)
    canvas.text(left, 6, title)
    x = left
    for (name, _), color in zip(series, SERIES, strict=False):
        canvas.rect(x, height - 26, x + 12, height - 14, color)
        x += 20 + canvas.text(x + 20, height - 27, name) + 24
    canvas.text(width - right - 12 * 13, height - 27, "ttl (log)")
    canvas.text(8, top - 24, "hit rate (%)")
    if path is not None:
        path.write_bytes(canvas.png())
    return canvas

"""``loss.png``: train and validation loss against step, drawn without dependencies.

A line plot needs little: a pixel buffer, straight lines, a few digits and letters
(a 5x7 bitmap font) and PNG's encoding (zlib + CRC-framed chunks, both in the standard
library). Drawing it here keeps matplotlib (and its ~40 MB of dependencies and a second
of import time on every rank) out of the trainer.
"""

from __future__ import annotations

import math
import os
import struct
import zlib

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
TRAIN_COLOR: Color = (31, 119, 180)
VAL_COLOR: Color = (255, 127, 14)

# 5x7 glyphs, one int per row, bit 4 the leftmost pixel.
FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14),
    "2": (14, 17, 1, 2, 4, 8, 31), "3": (31, 2, 4, 2, 1, 17, 14),
    "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8),
    "8": (14, 17, 17, 14, 17, 17, 14), "9": (14, 17, 17, 15, 1, 2, 12),
    ".": (0, 0, 0, 0, 0, 12, 12), "-": (0, 0, 0, 31, 0, 0, 0), " ": (0,) * 7,
    "a": (0, 0, 14, 1, 15, 17, 15), "e": (0, 0, 14, 17, 31, 16, 14),
    "i": (4, 0, 12, 4, 4, 4, 14), "l": (12, 4, 4, 4, 4, 4, 14),
    "n": (0, 0, 22, 25, 17, 17, 17), "o": (0, 0, 14, 17, 17, 17, 14),
    "p": (0, 0, 30, 17, 30, 16, 16), "r": (0, 0, 22, 25, 16, 16, 16),
    "s": (0, 0, 14, 16, 14, 1, 30), "t": (8, 8, 28, 8, 8, 9, 6),
    "v": (0, 0, 17, 17, 17, 10, 4),
}
SCALE = 2            # font pixels are SCALE x SCALE
ADVANCE = 6 * SCALE  # glyph width plus one column of spacing


class Canvas:
    """An RGB pixel buffer that writes itself as PNG."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        """Bresenham's line; ``thick`` > 1 repeats it shifted down and right."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.set(x0 + t, y0, color)
                self.set(x0, y0 + t, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK) -> None:
        """``text`` with its top-left corner at (x, y); characters without a glyph are
        left blank."""
        for k, char in enumerate(text):
            for row, bits in enumerate(FONT.get(char, FONT[" "])):
                for col in range(5):
                    if bits >> (4 - col) & 1:
                        px, py = x + k * ADVANCE + col * SCALE, y + row * SCALE
                        self.rect(px, py, px + SCALE - 1, py + SCALE - 1, color)

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride])
                       for y in range(self.height))  # filter type 0 on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values (steps of 1, 2 or 5 x 10^k) covering [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def plot_losses(path: str, train: list[tuple[int, float]], val: list[tuple[int, float]],
                width: int = 640, height: int = 400) -> None:
    """Write a PNG of ``train`` and ``val`` (lists of (step, loss)) to ``path``."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    points = train + val
    if points:
        x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
        y_low, y_high = min(p[1] for p in points), max(p[1] for p in points)
    else:
        x_low, x_high, y_low, y_high = 0, 1, 0.0, 1.0
    x_ticks, y_ticks = nice_ticks(x_low, x_high), nice_ticks(y_low, y_high)
    x_low, x_high = min(x_low, x_ticks[0]), max(x_high, x_ticks[-1], x_low + 1)
    y_low, y_high = min(y_low, y_ticks[0]), max(y_high, y_ticks[-1], y_low + 1e-6)

    def to_pixel(step: float, loss: float) -> tuple[int, int]:
        px = left + (step - x_low) / (x_high - x_low) * (right - left)
        py = bottom - (loss - y_low) / (y_high - y_low) * (bottom - top)
        return round(px), round(py)

    for value in y_ticks:
        _, py = to_pixel(x_low, value)
        canvas.line(left, py, right, py, GRID)
        label = _label(value, y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0)
        canvas.text(left - 8 - len(label) * ADVANCE, py - 7, label)
    for value in x_ticks:
        px, _ = to_pixel(value, y_low)
        canvas.line(px, top, px, bottom, GRID)
        label = f"{value:.0f}"
        canvas.text(px - len(label) * ADVANCE // 2, bottom + 8, label)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.text((left + right) // 2 - 2 * ADVANCE, height - 18, "step")
    canvas.text(8, 8, "loss")
    for series, color in ((train, TRAIN_COLOR), (val, VAL_COLOR)):
        pixels = [to_pixel(s, v) for s, v in series]
        for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
            canvas.line(x0, y0, x1, y1, color, thick=2)
        if series is val:
            for x, y in pixels:  # evaluations are few: mark each one
                canvas.rect(x - 3, y - 3, x + 3, y + 3, color)
    for k, (name, color) in enumerate((("train", TRAIN_COLOR), ("val", VAL_COLOR))):
        x, y = right - 100, top + 6 + k * 20
        canvas.rect(x, y + 4, x + 16, y + 8, color)
        canvas.text(x + 24, y, name)
    with open(path + ".partial", "wb") as f:
        f.write(canvas.png())
    os.replace(path + ".partial", path)  # a viewer never sees half a file

"""Image grids: one row per prompt (its text on the left), one labelled column per model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from PIL import Image, ImageDraw, ImageFont

BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)


@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of a grid of `rows` x `cols` images of `cell_w` x `cell_h`."""

    cell_w: int
    cell_h: int
    label_w: int = 240  # the prompt column on the left
    header_h: int = 22  # the column labels on top
    pad: int = 4  # around and between images
    font_size: int = 12

    def size(self, rows: int, cols: int) -> tuple[int, int]:
        return (self.label_w + cols * (self.cell_w + self.pad) + self.pad,
                self.header_h + rows * (self.cell_h + self.pad) + self.pad)

    def origin(self, row: int, col: int) -> tuple[int, int]:
        """Top-left corner of image (row, col)."""
        return (self.label_w + self.pad + col * (self.cell_w + self.pad),
                self.header_h + self.pad + row * (self.cell_h + self.pad))


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has only the fixed bitmap font
        return ImageFont.load_default()


def _pieces(draw: ImageDraw.ImageDraw, word: str, font, width: int) -> list[str]:
    """`word` cut into pieces of at most `width` pixels (after a '-' where one fits), for words wider than a line."""
    out: list[str] = []
    while draw.textlength(word, font=font) > width and len(word) > 1:
        cut = max((i for i in range(1, len(word)) if draw.textlength(word[:i], font=font) <= width), default=1)
        dash = word.rfind("-", 0, cut)
        cut = dash + 1 if dash > 0 else cut
        out.append(word[:cut])
        word = word[cut:]
    return out + [word]


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels (a word wider than that is cut into pieces); the last kept line ends in
    '...' when text is cut."""
    lines: list[str] = []
    cur = ""
    for word in (piece for w in text.split() for piece in _pieces(draw, w, font, width)):
        trial = f"{cur} {word}".strip()
        if cur and draw.textlength(trial, font=font) > width:
            lines.append(cur)
            cur = word
        else:
            cur = trial
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and draw.textlength(last + "...", font=font) > width:
            last = last[:-1]
        lines[-1] = last.rstrip() + "..."
    return lines


def _titles(columns: list[str], layout: GridLayout) -> list[list[str]]:
    """Each column's title wrapped to its own column's width (at most 4 lines)."""
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    return [_wrap(measure, name, _font(layout.font_size), layout.cell_w + layout.pad, max_lines=4) for name in columns]


def grid_layout(columns: list[str], cell_w: int, cell_h: int) -> GridLayout:
    """The layout `draw_grid` uses: the header as tall as the longest wrapped column title."""
    layout = GridLayout(cell_w=cell_w, cell_h=cell_h)
    lines = max((len(t) for t in _titles(columns, layout)), default=1)
    return replace(layout, header_h=max(layout.header_h, lines * (layout.font_size + 2) + 6))


def draw_grid(labels: list[str], images: list[list[Image.Image]], columns: list[str]) -> Image.Image:
    """One row per label with its images in `columns` order; all images must share one size. Each column's title
    stays over its own column, wrapped to its width."""
    if len(labels) != len(images) or any(len(r) != len(columns) for r in images):
        raise ValueError(f"grid needs {len(columns)} images for each of the {len(labels)} rows")
    layout = grid_layout(columns, *images[0][0].size)
    if any(im.size != (layout.cell_w, layout.cell_h) for r in images for im in r):
        raise ValueError(f"every grid image must be {layout.cell_w}x{layout.cell_h}")
    font = _font(layout.font_size)
    line_h = layout.font_size + 2
    titles = _titles(columns, layout)
    canvas = Image.new("RGB", layout.size(len(labels), len(columns)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for c, lines in enumerate(titles):
        x, _ = layout.origin(0, c)
        for i, line in enumerate(lines):
            tw = draw.textlength(line, font=font)
            draw.text((x + (layout.cell_w - tw) / 2, 3 + i * line_h), line, fill=INK, font=font)
    max_lines = max(1, layout.cell_h // line_h)
    for r, (label, row) in enumerate(zip(labels, images)):
        _, y = layout.origin(r, 0)
        for i, line in enumerate(_wrap(draw, label, font, layout.label_w - 2 * layout.pad, max_lines)):
            draw.text((layout.pad, y + i * line_h), line, fill=INK, font=font)
        for c, im in enumerate(row):
            canvas.paste(im.convert("RGB"), layout.origin(r, c))
    return canvas

"""The tray icon, drawn with Pillow: its colour says the state (no image files to ship)."""

from __future__ import annotations

from PIL import Image, ImageDraw

COLOURS = {
    "stopped": (140, 149, 159),
    "idle": (31, 111, 235),
    "generating": (26, 127, 55),
    "pulling": (130, 80, 223),
    "error": (207, 34, 46),
}


def icon_image(status: str, size: int = 64) -> Image.Image:
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, size - 1, size - 1), radius=size // 5, fill=COLOURS.get(status, COLOURS["error"]))
    unit = size / 64
    # Three bars, as on the dashboard's icon; a stopped server's are hollow.
    for x, top in ((14, 28), (28, 18), (42, 34)):
        box = (x * unit, top * unit, (x + 8) * unit, 46 * unit)
        if status == "stopped":
            draw.rectangle(box, outline=(255, 255, 255), width=max(1, size // 32))
        else:
            draw.rectangle(box, fill=(255, 255, 255))
    return image

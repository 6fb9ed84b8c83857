"""Write the bundled sample images and the vision job that uses them (deterministic bytes).

    python scripts/make_sample_images.py

sample_data/images/ gets eight small PNGs of different sizes (shapes, stripes, a gradient) and
sample_data/images.jsonl OpenAI-style chat rows whose image urls are relative to its folder:
one image, two images between text, and text only.
"""

import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "sample_data"


def red_square() -> Image.Image:
    img = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(img).rectangle([12, 12, 51, 51], fill=(220, 30, 30))
    return img


def blue_circle() -> Image.Image:
    img = Image.new("RGB", (96, 96), (245, 245, 220))
    ImageDraw.Draw(img).ellipse([14, 14, 81, 81], fill=(30, 60, 200))
    return img


def green_triangle() -> Image.Image:
    img = Image.new("RGB", (80, 64), (20, 20, 20))
    ImageDraw.Draw(img).polygon([(40, 6), (74, 58), (6, 58)], fill=(40, 190, 60))
    return img


def stripes(vertical: bool) -> Image.Image:
    img = Image.new("RGB", (120, 90), "white")
    draw = ImageDraw.Draw(img)
    colors = [(230, 120, 20), (250, 220, 40), (120, 40, 160)]
    for i in range(0, 120 if vertical else 90, 10):
        box = [i, 0, i + 9, 89] if vertical else [0, i, 119, i + 9]
        draw.rectangle(box, fill=colors[(i // 10) % 3])
    return img


def checkerboard() -> Image.Image:
    img = Image.new("RGB", (48, 48), "white")
    draw = ImageDraw.Draw(img)
    for y in range(0, 48, 8):
        for x in range(0, 48, 8):
            if (x + y) // 8 % 2:
                draw.rectangle([x, y, x + 7, y + 7], fill="black")
    return img


def gradient() -> Image.Image:
    img = Image.new("RGB", (160, 120))
    img.putdata([(x * 255 // 159, y * 255 // 119, 128) for y in range(120) for x in range(160)])
    return img


def scene() -> Image.Image:
    """A sky, a sun, a house."""
    img = Image.new("RGB", (144, 112), (135, 200, 250))
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 80, 143, 111], fill=(60, 160, 60))
    draw.ellipse([104, 10, 132, 38], fill=(255, 220, 0))
    draw.rectangle([30, 50, 80, 90], fill=(180, 90, 60))
    draw.polygon([(24, 52), (55, 26), (86, 52)], fill=(120, 30, 30))
    return img


IMAGES = {
    "red_square.png": red_square,
    "blue_circle.png": blue_circle,
    "green_triangle.png": green_triangle,
    "vertical_stripes.png": lambda: stripes(True),
    "horizontal_stripes.png": lambda: stripes(False),
    "checkerboard.png": checkerboard,
    "gradient.png": gradient,
    "house.png": scene,
}


def image_part(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"images/{name}"}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def rows() -> list[dict]:
    names = list(IMAGES)
    out = []
    for i, name in enumerate(names):
        question = ["Describe the picture.", "What shape is this?", "What colors do you see?"]
        content = [text_part(question[i % 3]), image_part(name)]
        out.append({"messages": [{"role": "user", "content": content}]})
    out.append({"messages": [{"role": "user", "content": [
        text_part("Compare this picture"), image_part("red_square.png"),
        text_part("with this one"), image_part("blue_circle.png"),
        text_part("and say which is larger.")]}]})
    out.append({"messages": [
        {"role": "system", "content": "You describe images briefly."},
        {"role": "user", "content": [image_part("vertical_stripes.png"),
                                     image_part("horizontal_stripes.png"),
                                     text_part("How do the stripes differ?")]}]})
    out.append({"messages": [{"role": "user", "content": "Explain recursion in two sentences."}]})
    out.append({"messages": [{"role": "user", "content": [
        text_part("Write a short poem about the water cycle.")]}]})
    return [{"custom_id": f"img-{i:02d}", **row, "max_tokens": 16} for i, row in enumerate(out)]


if __name__ == "__main__":
    folder = OUT / "images"
    folder.mkdir(exist_ok=True)
    for name, draw in IMAGES.items():
        draw().save(folder / name, optimize=False)
    (OUT / "images.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows()))
    print(folder)

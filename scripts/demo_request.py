"""Print the demo's chat request as JSON (stdout), and a short form of it (stderr).

For a model with an image processor, the message carries a 64x32 picture (sky
over sea, drawn with Pillow, sent inline as a PNG data URL); otherwise text only.
Usage: demo_request.py MODEL_DIR
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path


def picture_url() -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64, 32), (40, 90, 200))
    ImageDraw.Draw(image).rectangle([0, 0, 63, 12], fill=(150, 200, 255))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main(model: str) -> None:
    if (Path(model) / "processor_config.json").is_file():
        content: object = [
            {"type": "image_url", "image_url": {"url": picture_url()}},
            {"type": "text", "text": "What is in this picture?"},
        ]
    else:
        content = "Hello! Write one sentence about the sea."
    request = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 32,
        "temperature": 0,
    }
    print(json.dumps(request))
    shown = json.dumps(request, indent=2)
    if isinstance(content, list):
        shown = shown.replace(
            content[0]["image_url"]["url"], "data:image/png;base64,..."
        )
    print(shown, file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])

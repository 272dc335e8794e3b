"""Image input checked before any model work (api/images.py, image_checks.py, image_fetch.py):
real image files made with Pillow (PNG, JPEG, GIF, WebP), a truncated file, a bomb's header, a
non-image, the per-request bounds, data URLs, and URLs under /api/pull's link policy, fetched
from a real local HTTP server (redirects to a private address, bytes and time bounds)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import struct
import threading
import zlib
from contextlib import contextmanager
from typing import Iterator

import pytest
from PIL import Image

from localserve.api.image_checks import check_image
from localserve.api.images import ImageLimits, ImageParts, kept_images
from localserve.errors import InvalidRequestError
from localserve.protocol.media import MEDIA_MARKER
from localserve.pull.policy import UrlPolicy


def image_bytes(fmt: str, size: tuple[int, int] = (32, 24), colour: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def noisy_jpeg(size: tuple[int, int] = (128, 128)) -> bytes:
    out = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(out, format="JPEG")
    return out.getvalue()


def png_header_claiming(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR declaring width x height, then one tiny IDAT and IEND: what
    a decompression bomb's header looks like (64 bytes that say 10 gigapixels)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def resolve(parts: ImageParts) -> list:
    return asyncio.run(parts.resolve())


def refused(parts: ImageParts) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        resolve(parts)
    return e.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_a_real_image_passes_as_sent(fmt):
    data = image_bytes(fmt)
    image = check_image(data, "x", max_pixels=10_000)
    assert (image.width, image.height, image.format) == (32, 24, fmt.lower())
    assert image.data == data and image.sha256 == hashlib.sha256(data).hexdigest()


def test_webp_is_re_encoded_as_png_for_the_engine_decoder():
    image = check_image(image_bytes("WEBP"), "x", max_pixels=10_000)
    assert image.format == "png" and image.data.startswith(b"\x89PNG")
    assert Image.open(io.BytesIO(image.data)).size == (32, 24)


@pytest.mark.parametrize("data, words", [
    (b"", "is empty"),
    (b"hello, this is text and not a picture", "is not an image"),
    (b"%PDF-1.7\n" + b"0" * 200, "is not an image"),
    (image_bytes("PNG", (64, 64))[:-30], "damaged or truncated PNG"),
    (noisy_jpeg()[:len(noisy_jpeg()) // 2], "damaged or truncated JPEG"),
    (png_header_claiming(100_000, 100_000), "max_image_pixels"),  # past Pillow's own bound too
    (png_header_claiming(9_000, 9_000), "declares 9000x9000 pixels"),
    (png_header_claiming(0, 5), "is not an image"),  # Pillow refuses a zero dimension in the header
])
def test_bad_bytes_are_a_400_naming_the_field(data, words):
    with pytest.raises(InvalidRequestError) as e:
        check_image(data, "messages[0].content[1].image_url.url", max_pixels=25_000_000)
    assert e.value.param == "messages[0].content[1].image_url.url" and words in e.value.message


def test_the_pixel_bound_is_read_from_the_header_before_any_decode():
    # 5000x5000 of one colour compresses to a few kB: its header alone is enough to refuse it.
    data = image_bytes("PNG", (5000, 5000))
    assert len(data) < 100_000
    with pytest.raises(InvalidRequestError, match="max_image_pixels"):
        check_image(data, "x", max_pixels=1_000_000)


def test_data_urls_and_base64_decode_to_checked_images():
    parts = ImageParts()
    png, jpeg = image_bytes("PNG"), image_bytes("JPEG")
    assert parts.add_url("data:image/png;base64," + b64(png), "a") == MEDIA_MARKER
    assert parts.add_base64(b64(jpeg)[:40] + "\n" + b64(jpeg)[40:], "b") == MEDIA_MARKER  # MIME line breaks
    images = resolve(parts)
    assert [i.data for i in images] == [png, jpeg] and [i.format for i in images] == ["png", "jpeg"]


@pytest.mark.parametrize("url, words", [
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png,rawbytes", "base64 data: URL"),
    ("data:nonsense", "well-formed data: URL"),
    ("ftp://example.com/x.png", "https://"),
    ("http://example.com/x.png", "http:// are not allowed"),
    ("https://127.0.0.1/x.png", "loopback, private"),
    ("https://10.0.0.8/x.png", "loopback, private"),
    ("https://[::1]/x.png", "loopback, private"),
    ("https://localhost/x.png", "loopback, private"),
])
def test_bad_urls_are_refused_while_parsing(url, words):
    with pytest.raises(InvalidRequestError) as e:
        ImageParts().add_url(url, "messages[0].content[0].image_url.url")
    assert e.value.param == "messages[0].content[0].image_url.url" and words in e.value.message
    assert "image URLs" in e.value.message or "URL" in e.value.message


def test_bad_base64_names_its_field():
    parts = ImageParts()
    parts.add_base64("not base64 at all!", "images[0]")
    assert refused(parts).param == "images[0]"
    with pytest.raises(InvalidRequestError):
        ImageParts().add_base64(5, "images[0]")


def test_per_request_bounds_count_and_bytes():
    parts = ImageParts(ImageLimits(max_images=2))
    parts.add_base64(b64(image_bytes("PNG")), "images[0]")
    parts.add_base64(b64(image_bytes("PNG")), "images[1]")
    with pytest.raises(InvalidRequestError, match="max_images_per_request") as e:
        parts.add_base64(b64(image_bytes("PNG")), "images[2]")
    assert e.value.param == "images[2]"
    one = image_bytes("PNG", (300, 300), "blue")
    parts = ImageParts(ImageLimits(max_bytes=len(one) + 10))
    parts.add_base64(b64(one), "images[0]")
    parts.add_base64(b64(one), "images[1]")  # each fits, the two together do not
    error = refused(parts)
    assert error.param == "images[1]" and "max_image_bytes" in error.message
    with pytest.raises(InvalidRequestError, match="max_image_bytes"):  # refused before decoding
        ImageParts(ImageLimits(max_bytes=10)).add_base64("A" * 1000, "images[0]")


def test_markers_in_the_clients_own_text_are_refused_with_images():
    parts = ImageParts()
    parts.add_base64(b64(image_bytes("PNG")), "images[0]")
    parts.check_markers([MEDIA_MARKER + "what is this?"], "messages")
    with pytest.raises(InvalidRequestError) as e:
        parts.check_markers([MEDIA_MARKER + f"what is {MEDIA_MARKER}?"], "messages")
    assert e.value.param == "messages"
    ImageParts().check_markers([f"llama.cpp's marker is {MEDIA_MARKER}"], "messages")  # no images: plain text


def test_kept_images_follow_the_messages_a_cut_history_keeps():
    a, b, c = (check_image(image_bytes("PNG", colour=col), "x", max_pixels=10_000) for col in ("red", "green", "blue"))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": MEDIA_MARKER * 2 + "old"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": MEDIA_MARKER + "new"}]
    assert kept_images(messages, messages, [a, b, c]) == [a, b, c]
    assert kept_images([messages[0], messages[3]], messages, [a, b, c]) == [c]


class _Images(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802
        status, headers, body = self.routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
        self.end_headers()
        if body == b"SLOW":
            import time
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def image_server(routes: dict[str, tuple[int, dict[str, str], bytes]]) -> Iterator[str]:
    _Images.routes = routes
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_urls_are_fetched_under_the_pull_policy_with_bounds():
    png = image_bytes("PNG")
    with image_server({"/a.png": (200, {}, png), "/gone.png": (404, {}, b"no"),
                       "/text": (200, {}, b"just text"),
                       "/big.png": (200, {"Content-Length": "99999999"}, b""),
                       "/slow.png": (200, {"Content-Length": "40"}, b"SLOW"),
                       "/hop": (302, {"Location": "https://localhost:1/x.png"}, b"")}) as base:
        # 127.0.0.1 allowed as a LAN mirror would be: the policy's own escape hatch.
        allowed = ImageLimits(policy=UrlPolicy(frozenset({"127.0.0.1"}), what="image URLs"), fetch_timeout=1.0)
        parts = ImageParts(allowed)
        parts.add_url(f"{base}/a.png", "u")
        assert resolve(parts)[0].data == png
        for path, words in [("/gone.png", "HTTP 404"), ("/text", "is not an image"), ("/big.png", "max_image_bytes"),
                            ("/slow.png", "image_fetch_timeout"), ("/hop", "loopback, private")]:
            parts = ImageParts(allowed)
            parts.add_url(f"{base}{path}", "messages[0].content[0].image_url.url")
            error = refused(parts)
            assert error.param == "messages[0].content[0].image_url.url" and words in error.message, (path, error)
        # A closed port answers as an unanswered one: no "refused" that would tell open ports apart.
        parts = ImageParts(allowed)
        parts.add_url("http://127.0.0.1:1/x.png", "u")
        error = refused(parts)
        assert "could not be fetched" in error.message and "refused" not in error.message.lower()
        # Not allowed: the same server over http://, or over https:// at a loopback address, is
        # refused before connecting.
        with pytest.raises(InvalidRequestError, match="http:// are not allowed"):
            ImageParts().add_url(f"{base}/a.png", "u")
        with pytest.raises(InvalidRequestError, match="loopback, private"):
            ImageParts().add_url(base.replace("http:", "https:") + "/a.png", "u")


def test_responses_items_keep_images_in_place_and_name_their_input():
    from localserve.api.responses_items import chat_messages, parse_input

    url = "data:image/png;base64," + b64(image_bytes("PNG"))
    stored = parse_input([{"role": "user", "content": [{"type": "input_image", "image_url": url}]}])
    items = parse_input([{"role": "user", "content": [
        {"type": "input_text", "text": "and this?"}, {"type": "input_image", "image_url": url, "detail": "low"}]}])
    assert items[0]["content"] == [{"type": "input_text", "text": "and this?"},
                                   {"type": "input_image", "image_url": url, "detail": "low"}]
    parts = ImageParts()
    messages = chat_messages(None, stored + items, parts, own_from=1)
    assert [m["content"] for m in messages] == [MEDIA_MARKER, "and this?" + MEDIA_MARKER]
    assert [r.param for r in parts.refs] == ["previous_response_id", "input[0].content[1].image_url"]
    with pytest.raises(InvalidRequestError) as e:
        parse_input([{"role": "assistant", "content": [{"type": "input_image", "image_url": url}]}])
    assert e.value.param == "input[0].content[0]"


def test_for_model_hands_images_only_to_a_model_with_a_projector():
    from types import SimpleNamespace

    parts = ImageParts()
    parts.add_base64(b64(image_bytes("PNG")), "images[0]")
    images = resolve(parts)
    seer = SimpleNamespace(name="seer:Q8_0", info=SimpleNamespace(vision=True))
    blind = SimpleNamespace(name="blind:Q4_1", info=SimpleNamespace(vision=False))
    assert parts.for_model(seer) == images
    with pytest.raises(InvalidRequestError) as e:
        parts.for_model(blind)
    assert e.value.param == "images[0]" and "'blind:Q4_1' takes no images" in e.value.message
    assert ImageParts().for_model(blind) == []  # no images: nothing to refuse

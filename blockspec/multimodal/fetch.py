"""An `image_url` → a decoded image, under the server's media policy: `data:` URLs always;
http(s) only when remote fetching is on (optionally only from listed domains, redirects checked
too), with a timeout and a byte limit; `file://` only under an allowed directory. Decoding is
bounded too (pixels before the pixels are read). Every failure is an ImageError: the client's 400."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:          # Pillow is imported where an image is decoded (the engine never needs it)
    from PIL import Image


class ImageError(ValueError):
    """An image the request cannot use: says why, in one sentence."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote: bool = True                 # http(s) image URLs
    allowed_domains: tuple[str, ...] = ()     # hosts (and their subdomains) http(s) may reach; () = any
    local_dir: Path | None = None             # file:// URLs must resolve under it; None = refused
    timeout_s: float = 10.0
    max_bytes: int = 20 * 1024 * 1024         # encoded image, per image
    max_pixels: int = 64 * 1024 * 1024        # decoded width × height, per image


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    return decode(read_bytes(url, policy), policy)


def read_bytes(url: str, policy: MediaPolicy) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, policy)
    if scheme in ("http", "https"):
        return fetch_remote(url, policy)
    if scheme == "file":
        return read_local(url, policy)
    raise ImageError("an image URL must be a data: URL, an http(s) URL or a file:// URL")


def data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: image URL must be base64-encoded (data:image/png;base64,...)")
    if not header.startswith("image/"):
        raise ImageError(f"a data: URL of type {header.removesuffix(';base64') or 'none'!r} is not an image")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ImageError(f"the image has more than the limit of {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL is not valid base64") from None


def domain_allowed(url: str, policy: MediaPolicy) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return not policy.allowed_domains or any(host == d or host.endswith("." + d) for d in policy.allowed_domains)


class CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.lower().startswith(("http://", "https://")) or not domain_allowed(newurl, self.policy):
            raise ImageError("the image URL redirects to a host this server may not fetch from")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise ImageError("this server does not fetch remote images; send the image as a data: URL")
    if not domain_allowed(url, policy):
        raise ImageError(f"this server fetches images only from {', '.join(policy.allowed_domains)}")
    opener = urllib.request.build_opener(CheckedRedirects(policy))
    request = urllib.request.Request(url, headers={"User-Agent": "blockspec"})
    try:
        with opener.open(request, timeout=policy.timeout_s) as response:
            body = response.read(policy.max_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageError(f"fetching the image URL failed: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"fetching the image URL failed: {reason}") from None
    if len(body) > policy.max_bytes:
        raise ImageError(f"the image has more than the limit of {policy.max_bytes} bytes")
    return body


def read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.local_dir is None:
        raise ImageError("this server does not read local image files")
    root = Path(policy.local_dir).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise ImageError(f"file:// image URLs must name a file under {root}")
    if path.stat().st_size > policy.max_bytes:
        raise ImageError(f"the image has more than the limit of {policy.max_bytes} bytes")
    return path.read_bytes()


def decode(data: bytes, policy: MediaPolicy) -> Image.Image:
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(data))
    except Exception:   # Pillow raises many kinds for bytes that are no image
        raise ImageError("the image could not be decoded (not an image, or a format Pillow does not read)") from None
    if image.width * image.height > policy.max_pixels:
        raise ImageError(f"the image has {image.width} × {image.height} pixels; the limit is {policy.max_pixels}")
    try:
        image.load()
    except Exception:
        raise ImageError("the image could not be decoded (truncated or corrupt)") from None
    if image.width < 1 or image.height < 1:
        raise ImageError("the image is empty")
    return image

"""Images of a chat request (image_url parts): counted against --limit-images-per-prompt, fetched
and decoded under the server's media policy (multimodal/fetch.py), processed as the checkpoint's
image processor says, and placed in the rendered prompt (each placeholder expanded to the image's
rows, so images count against --max-model-len and the token budget). Every failure is a 400
naming the part. Runs on a worker thread (fetching and resizing block)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from blockspec.multimodal import ImageError, MediaPolicy, load_image, process_image
from blockspec.server.errors import ApiError
from blockspec.server.protocol import ChatCompletionRequest
from blockspec.server.request_building import Prompt
from blockspec.server.settings import ServerSettings
from blockspec.server.state import EngineHandle


def image_parts(body: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(param, url) of every image part, in the order the chat template renders them."""
    parts = []
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            parts += [(f"messages[{i}].content[{j}].image_url", part.image_url.url)
                      for j, part in enumerate(message.content) if part.type == "image_url"]
    return parts


def check_images(llm: EngineHandle, settings: ServerSettings, body: ChatCompletionRequest) -> None:
    """The refusals that need no fetching: a model without a vision tower, too many images."""
    parts = image_parts(body)
    if not parts:
        return
    if not llm.takes_images:
        raise ApiError(400, "This model takes no images (its checkpoint has no vision tower, or it runs "
                            "tensor parallel); send text content only.", parts[0][0])
    if len(parts) > settings.limit_images_per_prompt:
        raise ApiError(400, f"This request has {len(parts)} images; this server takes at most "
                            f"{settings.limit_images_per_prompt} per prompt.", "messages")


def media_policy(settings: ServerSettings) -> MediaPolicy:
    domains = tuple(d.strip().lower() for d in (settings.allowed_media_domains or "").split(",") if d.strip())
    local = Path(settings.allowed_local_media_path) if settings.allowed_local_media_path else None
    return MediaPolicy(allow_remote=settings.remote_images, allowed_domains=domains, local_dir=local,
                       timeout_s=settings.media_fetch_timeout, max_bytes=settings.max_image_bytes)


def with_images(llm: EngineHandle, settings: ServerSettings, body: ChatCompletionRequest, prompt: Prompt) -> Prompt:
    """The rendered prompt with its images in place (unchanged without image parts)."""
    parts = image_parts(body)
    if not parts:
        return prompt
    policy = media_policy(settings)
    images = []
    for param, url in parts:
        try:
            images.append(process_image(load_image(url, policy), llm.image_processor))
        except ImageError as exc:
            raise ApiError(400, f"Invalid '{param}': {exc}.", param) from None
    try:
        token_ids, multimodal = llm.image_prompt(prompt.token_ids, images)
    except ImageError as exc:
        raise ApiError(400, f"Invalid 'messages': {exc}.", "messages") from None
    return dataclasses.replace(prompt, token_ids=token_ids, multimodal=multimodal)

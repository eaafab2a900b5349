"""The server's settings: the engine options plus the server's own, each declared once as a field
(blockspec/options.py turns them into `serve` flags)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from blockspec.config import EngineOptions
from blockspec.options import SERVE, option

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerSettings(EngineOptions):
    host: str = option("127.0.0.1", "address to listen on", (SERVE,))
    port: int = option(8000, "port to listen on", (SERVE,))
    api_key: str | None = option(None, "require this key as 'Authorization: Bearer KEY' (none: no auth)", (SERVE,))
    served_model_name: str | None = option(None, "the model's name in the API (none: the last part of --model)",
                                           (SERVE,))
    cors: str | None = option(None, "comma-separated allowed origins (none: CORS off)", (SERVE,))
    max_body_bytes: int = option(8 * 1024 * 1024, "largest request body accepted (more: 413)", (SERVE,))
    shutdown_timeout: float = option(30.0, "seconds SIGTERM lets open requests finish (new ones get 503) "
                                     "before ending the rest with an error", (SERVE,))
    log_level: str = option("info", "level of the server's log (stderr)", (SERVE,), choices=LOG_LEVELS)
    access_log: bool = option(True, "log one line per HTTP request (uvicorn's access log)", (SERVE,))
    ui: bool = option(True, "serve the playground, a chat page showing each verify cycle, at / "
                      "(--no-ui: the API only)", (SERVE,))
    limit_images_per_prompt: int = option(8, "images one request may send (vLLM's --limit-mm-per-prompt; "
                                          "more: 400; 0: none)", (SERVE,), metavar="N")
    remote_images: bool = option(True, "fetch http(s) image URLs (--no-remote-images: data: URLs only)", (SERVE,))
    allowed_media_domains: str | None = option(None, "comma-separated hosts http(s) images may come from, "
                                               "with their subdomains (none: any)", (SERVE,))
    allowed_local_media_path: str | None = option(None, "directory whose files file:// image URLs may name "
                                                  "(none: file:// refused)", (SERVE,), metavar="DIR")
    media_fetch_timeout: float = option(10.0, "seconds to fetch one http(s) image", (SERVE,))
    max_image_bytes: int = option(20 * 1024 * 1024, "largest encoded image (more: 400)", (SERVE,))
    log_stats_interval: float = option(10.0, "seconds between stats lines: throughput, running / waiting, "
                                       "KV usage, acceptance (0: none)", (SERVE,))

    def __post_init__(self) -> None:
        super().__post_init__()             # the engine's limits
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1 (got {self.max_body_bytes})")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0 (got {self.shutdown_timeout})")
        if not 0 <= self.log_stats_interval < float("inf"):
            raise ValueError(f"--log-stats-interval must be a number of seconds >= 0 (got {self.log_stats_interval})")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.limit_images_per_prompt < 0 or self.max_image_bytes < 1 or not self.media_fetch_timeout > 0:
            raise ValueError("--limit-images-per-prompt must be >= 0, --max-image-bytes and "
                             "--media-fetch-timeout positive")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")

    @property
    def model_name(self) -> str:
        """--served-model-name, else the last part of the model path or hub id."""
        model = self.model or ""
        return self.served_model_name or os.path.basename(model.rstrip("/\\")) or model

    @property
    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in (self.cors or "").split(",") if origin.strip()]

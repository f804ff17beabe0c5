"""``python -m api``: the web process (uvicorn on LLMQ_HOST:LLMQ_PORT)."""

from __future__ import annotations

import uvicorn

from api.app import create_app
from shared.config import load_settings
from shared.logging import configure_logging


def main() -> None:
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # uvicorn's loggers go through our structlog set-up
        access_log=False,
        timeout_graceful_shutdown=10,
        # Longer than the load balancer's idle timeout, so the balancer closes an idle connection
        # first and never reuses one llmq is closing (a spurious 502). uvicorn's default is 5 s.
        timeout_keep_alive=settings.http_keepalive_s,
    )


if __name__ == "__main__":
    main()

"""``python -m api.announce``: for `make run`, wait until a worker is warm, then print the URL
and a request to paste. Stays up afterwards, because honcho stops the whole stack when any of
its processes exits."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from shared.config import load_settings


def main() -> None:
    settings = load_settings()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    url = f"http://{host}:{settings.port}"
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as resp:
                if json.load(resp).get("ready_workers"):
                    break
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(1)
    body = json.dumps({"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 24}})
    print(
        f"\nllmq is ready at {url} (model: {settings.model_name})\n\n"
        f"  curl -s {url}/invocations -H 'Content-Type: application/json' -d '{body}'\n\n"
        f"  curl -sN {url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16, \"stream\": true}}'\n",
        flush=True,
    )
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()

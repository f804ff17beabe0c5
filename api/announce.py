"""``python -m api.announce``: for `make run`, wait until a worker is warm, then print the URL
and a request to paste. With the tiny model and LLMQ_MAX_LORAS set (`make run` sets it), it also
registers the tiny model's adapters (workers/tiny_model.py) and prints a request for one. Stays up
afterwards, because honcho stops the whole stack when any of its processes exits."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from shared.config import DEFAULT_MODEL, Settings, load_settings


def _register_tiny_adapters(settings: Settings, url: str) -> list[str]:
    """Register the tiny model's adapters over HTTP, as a user would; their names."""
    names = []
    for name, path in settings.tiny_adapter_dirs.items():
        body = json.dumps({"lora_name": name, "lora_path": str(path), "load_inplace": True}).encode()
        request = urllib.request.Request(f"{url}/v1/load_lora_adapter", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10):
                names.append(name)
        except (urllib.error.URLError, OSError) as exc:  # the stack still serves the base model
            print(f"could not register the tiny adapter {name}: {exc}", flush=True)
    return names


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
    if settings.console:
        print(f"The console (docs/console.md): {url}/console\n", flush=True)
    if settings.model == DEFAULT_MODEL and settings.max_loras and (names := _register_tiny_adapters(settings, url)):
        print(f"LoRA adapters {', '.join(names)} (docs/adapters.md):\n\n"
              f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{names[0]}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()

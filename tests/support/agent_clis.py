"""Claude Code and the Codex CLI as test clients: installed from npm at pinned versions into a
project-local prefix, and run headless against a local base URL with no account and no traffic
anywhere else (tests/e2e/test_agent_clis_capture.py).

Install: ``install(CLAUDE_CODE)`` / ``install(CODEX)`` run ``npm install --prefix
<repo>/.cache/npm/<name>-<version> --no-audit --no-fund <package>@<version>`` only when that
prefix has no working executable, and return the executable. Both packages are thin wrappers
around a native binary shipped as a platform-specific optional dependency (≈ 400 MB each,
installed); Claude Code's postinstall copies its binary over a stub, which is run by hand here
when npm skipped install scripts. No network is used once installed. ``.cache/`` is gitignored.

Run: ``claude_env``/``claude_argv`` and ``codex_home``/``codex_env``/``codex_argv`` build what
each CLI needs; ``run`` starts it in its own session with stdin at /dev/null (an open stdin makes
Claude Code wait 3 s and ``codex exec`` wait for ever) and kills the whole group on a timeout
(npm's ``codex`` is a node script that spawns the binary: killing node alone leaves it running).
With ``proxy=`` set to a ``CaptureServer`` URL, anything a CLI tries to reach beyond loopback
arrives there as a ``CONNECT`` and is refused; the settings below leave none.

``python -m tests.support.agent_clis`` runs both CLIs against a capture server and rewrites the
fixtures ``tests/fixtures/agents/{claude_code,codex}_request.json`` (sanitized); do that when a
pin moves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO

__all__ = [
    "CLAUDE_CODE", "CODEX", "FIXTURES", "NPM_PREFIX", "NpmCli", "NpmUnreachable", "claude_argv", "claude_env",
    "claude_shape", "codex_argv", "codex_env", "codex_home", "codex_shape", "in_ci", "install", "require", "run",
    "sanitize", "sizes",
]

NPM_PREFIX = Path(os.environ.get("LLMQ_NPM_PREFIX") or REPO / ".cache" / "npm")  # gitignored (.cache/)
FIXTURES = REPO / "tests" / "fixtures" / "agents"
INSTALL_TIMEOUT_S = 600


@dataclass(frozen=True)
class NpmCli:
    package: str
    version: str
    bin: str  # the name under node_modules/.bin

    @property
    def prefix(self) -> Path:
        return NPM_PREFIX / f"{self.package.replace('@', '').replace('/', '-')}-{self.version}"

    @property
    def executable(self) -> Path:
        return self.prefix / "node_modules" / ".bin" / self.bin


# Pinned: the newest on npm when this was written (`npm view <package> version`).
CLAUDE_CODE = NpmCli("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = NpmCli("@openai/codex", "0.171.0", "codex")


class NpmUnreachable(RuntimeError):
    """npm is not installed, or the registry could not be reached."""


# Once npm has failed to reach the registry (after its own retries, about 70 s), the next
# install in this process fails at once with the same reason.
_unreachable: list[NpmUnreachable] = []


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


# npm's error codes (and node's) for a registry it cannot reach.
_NETWORK = re.compile(r"\b(ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|EHOSTUNREACH|"
                      r"ERR_SOCKET_TIMEOUT|UNABLE_TO_GET_ISSUER_CERT|SELF_SIGNED_CERT_IN_CHAIN|EPROXY)\b|"
                      r"request to https?://\S+ failed")


def _version_of(exe: Path) -> str | None:
    """``exe --version``'s output, or None when it does not run."""
    if not exe.exists():
        return None
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, env={**os.environ, "HOME": str(NPM_PREFIX / ".home")})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _works(cli: NpmCli) -> bool:
    return cli.version in (_version_of(cli.executable) or "")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install(cli: NpmCli) -> Path:
    """The CLI's executable, installed first if its prefix has no working one. Raises
    ``NpmUnreachable`` when npm is missing or cannot reach the registry, RuntimeError otherwise."""
    if _works(cli):
        return cli.executable
    with _locked(cli.prefix.with_name(cli.prefix.name + ".lock")):
        if _works(cli):  # another process installed it while this one waited
            return cli.executable
        if _unreachable:
            raise NpmUnreachable(str(_unreachable[0]))
        try:
            _npm_install(cli)
        except NpmUnreachable as exc:
            _unreachable.append(exc)
            raise
    return cli.executable


def _npm_install(cli: NpmCli) -> None:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise NpmUnreachable("npm/node are not on PATH")
    cli.prefix.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(cli.prefix), "--no-audit", "--no-fund", "--no-update-notifier",
           "--loglevel=warn", f"{cli.package}@{cli.version}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise NpmUnreachable(f"{' '.join(cmd)} took over {INSTALL_TIMEOUT_S}s") from exc
    if out.returncode != 0:
        text = out.stdout + out.stderr
        kind = NpmUnreachable if _NETWORK.search(text) else RuntimeError
        raise kind(f"{' '.join(cmd)} exited {out.returncode}:\n{text[-3000:]}")
    # Claude Code's bin is a stub until its postinstall copies the native binary over it;
    # npm may skip install scripts (--ignore-scripts, or a future allowScripts default).
    postinstall = cli.prefix / "node_modules" / cli.package / "install.cjs"
    if not _works(cli) and postinstall.exists():
        subprocess.run(["node", str(postinstall)], cwd=postinstall.parent, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    if not _works(cli):
        raise RuntimeError(f"{cli.executable} --version does not print {cli.version} after npm install: "
                           f"{_version_of(cli.executable)!r}")


def require(cli: NpmCli) -> Path:
    """``install(cli)`` for a test: where npm cannot reach the registry, the test is skipped
    with the reason, except in CI (``CI`` set), where it fails: CI must prove the CLIs work."""
    import pytest

    try:
        return install(cli)
    except NpmUnreachable as exc:
        if in_ci():
            pytest.fail(f"CI: cannot install {cli.package}@{cli.version} from npm: {exc}")
        pytest.skip(f"npm registry unreachable, so {cli.package}@{cli.version} is not installed: {exc}")


# --- running them ----------------------------------------------------------------------------

def _base_env(home: Path, proxy: str | None) -> dict[str, str]:
    """A minimal environment (nothing of the caller's: no stray API keys or base URLs), with a
    throwaway HOME; with ``proxy``, every non-loopback request goes there."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb",
           "NO_COLOR": "1"}
    if proxy:
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = proxy
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    return env


# Claude Code: no telemetry, error reports, auto-update, feature flags or other "nonessential"
# traffic (each of the first covers the rest; all are set so a version that drops one still
# holds), and no retries: on a refused connection or a 5xx it otherwise retries 10 times over
# about three minutes.
CLAUDE_QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
}


def claude_env(base_url: str, home: Path, *, max_retries: int = 0, proxy: str | None = None,
               **extra: str) -> dict[str, str]:
    """The environment for ``claude -p`` against ``base_url`` (no ``/v1``: it appends
    ``/v1/messages?beta=true``) with an API key (any value: sent as ``x-api-key``)."""
    home.mkdir(parents=True, exist_ok=True)
    return {**_base_env(home, proxy), **CLAUDE_QUIET, "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "llmq-test-key", "CLAUDE_CODE_MAX_RETRIES": str(max_retries), **extra}


def claude_argv(exe: Path, prompt: str, *, model: str = "tiny-llama", max_turns: int | None = 1,
                extra: tuple[str, ...] = ()) -> list[str]:
    """``claude -p`` printing one JSON result. Not ``--dangerously-skip-permissions``: it refuses
    to run as root (CI containers); ``dontAsk`` denies whatever is not allowed instead of asking."""
    argv = [str(exe), "-p", prompt, "--model", model, "--output-format", "json", "--no-session-persistence",
            "--permission-mode", "dontAsk"]
    if max_turns is not None:
        argv += ["--max-turns", str(max_turns)]
    return argv + list(extra)


def codex_home(directory: Path, base_url: str, *, model: str = "tiny-llama", max_retries: int = 0,
               extra_toml: str = "") -> Path:
    """A ``CODEX_HOME`` whose config.toml points the ``llmq`` provider (Responses API, key from
    ``LLMQ_KEY``) at ``base_url`` (with ``/v1``: Codex appends ``/responses``), with analytics
    (OTLP metrics to ab.chatgpt.com) and the plugin marketplace sync (``git ls-remote`` of
    github.com/openai/plugins, api.github.com, chatgpt.com) off, and no retries: otherwise a
    refused connection is retried for ever and a 5xx 30 times over ~25 s."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "llmq"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.llmq]
name = "llmq"
base_url = "{base_url}"
env_key = "LLMQ_KEY"
wire_api = "responses"
request_max_retries = {max_retries}
stream_max_retries = {max_retries}

[analytics]
enabled = false

[features]
plugins = false
unbounded_connection_retries = false
{extra_toml}""")
    return directory


def codex_env(codex_home_dir: Path, home: Path, *, proxy: str | None = None, **extra: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {**_base_env(home, proxy), "CODEX_HOME": str(codex_home_dir), "LLMQ_KEY": "llmq-test-key", **extra}


def codex_argv(exe: Path, prompt: str, *, last_message: Path | None = None,
               extra: tuple[str, ...] = ()) -> list[str]:
    """``codex exec`` printing JSONL events; ``--strict-config`` so a setting this version no
    longer knows fails loudly rather than being ignored."""
    argv = [str(exe), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "--strict-config", "--color", "never"]
    if last_message is not None:
        argv += ["--output-last-message", str(last_message)]
    return argv + list(extra) + [prompt]


def run(argv: list[str], env: Mapping[str, str], cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Runs a CLI to the end in its own session, stdin at /dev/null; on a timeout kills its whole
    process group and raises ``subprocess.TimeoutExpired`` (with what it printed)."""
    proc = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout_s, out, err) from None
    finally:
        _kill_group(proc.pid)  # whatever it left behind (a shell snapshot, a spawned binary)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# --- what they send --------------------------------------------------------------------------

def _block_types(content: Any) -> list[str]:
    if isinstance(content, str):
        return ["str"]
    return sorted({b.get("type", "?") for b in content or [] if isinstance(b, dict)})


def claude_shape(request: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of Claude Code's Messages request llmq must handle (a captured request as
    ``Captured.as_dict()``); equal across runs of one version."""
    body, headers = request["body"], request["headers"]
    tools = body.get("tools") or []
    system = body.get("system") or []
    return {
        "path": request["path"], "query": request["query"],
        "anthropic_version": headers.get("anthropic-version"),
        "anthropic_beta": sorted((headers.get("anthropic-beta") or "").split(",")),
        "user_agent_prefix": (headers.get("user-agent") or "").split("/")[0],
        "keys": sorted(body),
        "stream": body.get("stream"), "max_tokens": body.get("max_tokens"),
        "thinking": body.get("thinking"), "output_config": body.get("output_config"),
        "context_management": body.get("context_management"), "tool_choice": body.get("tool_choice"),
        "metadata_keys": sorted(json.loads(body["metadata"]["user_id"])) if "metadata" in body else None,
        "system_blocks": [{"type": b.get("type"), "cache_control": b.get("cache_control")} for b in system],
        "tools": sorted(t.get("name", t.get("type", "?")) for t in tools),
        "tool_keys": sorted({k for t in tools for k in t}),
        "deferred_tools": sorted(t["name"] for t in tools if t.get("defer_loading")),
        "tools_with_type": sorted({t["type"] for t in tools if "type" in t}),
        "messages": [{"role": m["role"], "blocks": _block_types(m["content"])} for m in body.get("messages", [])],
    }


def codex_shape(request: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of Codex's Responses request llmq must handle; equal across runs of one version."""
    body, headers = request["body"], request["headers"]
    tools = body.get("tools") or []
    return {
        "path": request["path"], "query": request["query"],
        "accept": headers.get("accept"), "originator": headers.get("originator"),
        "user_agent_prefix": (headers.get("user-agent") or "").split("/")[0],
        "codex_headers": sorted(h for h in headers if h.startswith("x-codex") or h in ("session-id", "thread-id")),
        "keys": sorted(body),
        "stream": body.get("stream"), "store": body.get("store"), "tool_choice": body.get("tool_choice"),
        "parallel_tool_calls": body.get("parallel_tool_calls"), "reasoning": body.get("reasoning"),
        "include": body.get("include"), "text": body.get("text"), "instructions": "instructions" in body,
        "tools": [{"type": t.get("type"), "name": t.get("name"),
                   **({"tools": sorted(x.get("name", "?") for x in t["tools"])} if "tools" in t else {})}
                  for t in tools],
        "input": [{"type": i.get("type"), "role": i.get("role"), "blocks": _block_types(i.get("content")),
                   "id": (i.get("id") or "").split("_")[0] + "_" if "id" in i else None}
                  for i in body.get("input", [])],
    }


def sizes(body: Mapping[str, Any], prompt_keys: tuple[str, ...]) -> dict[str, int]:
    """Characters of JSON per top-level key named, and in all."""
    return {**{k: len(json.dumps(body.get(k), ensure_ascii=False)) for k in prompt_keys},
            "total": len(json.dumps(body, ensure_ascii=False))}


_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
_UNIX_MS = re.compile(r'(unix_ms\\?"\s*:\s*)\d{12,}')


def _today() -> set[str]:
    now = time.time()
    return {time.strftime("%Y-%m-%d", t) for t in (time.gmtime(now), time.localtime(now))}


def sanitize(obj: Any, paths: Mapping[str, str]) -> Any:
    """``obj`` with no secrets and nothing of this machine or run: each path in ``paths``
    (longest first) replaced by its label, then UUIDs (session, thread, installation ids),
    64-hex device ids, today's date and millisecond timestamps. Auth headers are already gone
    (``CaptureServer`` drops them)."""
    text = json.dumps(obj, ensure_ascii=False)
    for path in sorted(paths, key=len, reverse=True):
        text = text.replace(path, paths[path])
    text = _UUID.sub("00000000-0000-0000-0000-000000000000", text)
    text = _HEX64.sub("0" * 64, text)
    for day in _today():  # the prompt's current date; not the dated beta names and API version
        text = text.replace(day, "2000-01-01")
    text = _UNIX_MS.sub(r"\g<1>0", text)
    text = re.sub(r"OS Version: [^\\]*", "OS Version: <os>", text)
    return json.loads(text)


# --- rewriting the fixtures ------------------------------------------------------------------

def capture_both(workdir: Path) -> dict[str, dict[str, Any]]:
    """Runs each CLI once against a capture server (with the proxy trap); returns, per CLI, the
    sanitized fixture: version, argv, every hit, the first model request and its shape."""
    from tests.support.capture_server import CaptureServer

    fixtures = {}
    for name, cli in (("claude_code", CLAUDE_CODE), ("codex", CODEX)):
        exe = install(cli)
        root = workdir / name
        home, cwd = root / "home", root / "work"
        cwd.mkdir(parents=True, exist_ok=True)
        with CaptureServer() as srv:
            if name == "claude_code":
                argv, env = claude_argv(exe, "say hi"), claude_env(srv.url, home, proxy=srv.url)
                model_path = "/v1/messages"
            else:
                ch = codex_home(root / "codex-home", f"{srv.url}/v1")
                argv, env = codex_argv(exe, "say hi"), codex_env(ch, home, proxy=srv.url)
                model_path = "/v1/responses"
            started = time.monotonic()
            done = run(argv, env, cwd)
            took = time.monotonic() - started
            first = srv.first("POST", model_path)
            if done.returncode != 0 or first is None:
                raise RuntimeError(f"{name} exited {done.returncode} with {srv.hits()}\n{done.stdout}\n{done.stderr}")
            host = srv.url.removeprefix("http://")
            labels = {str(home): "<HOME>", str(cwd): "<CWD>", str(root): "<ROOT>", str(exe): f"<{cli.bin}>",
                      host: "127.0.0.1:PORT", str(NPM_PREFIX): "<NPM_PREFIX>"}
            request = first.as_dict()
            request["headers"].pop("content-length", None)
            shape = claude_shape(request) if name == "claude_code" else codex_shape(request)
            keys = ("system", "tools", "messages") if name == "claude_code" else ("instructions", "tools", "input")
            fixtures[name] = sanitize({
                "cli": cli.package, "version": cli.version, "argv": argv[1:],
                "env": {k: v for k, v in env.items() if k not in ("PATH",)},
                "seconds": round(took, 1), "hits": srv.hits(),
                "shape": shape, "chars": sizes(request["body"], keys),
                "request": {k: v for k, v in request.items() if k not in ("at",)},
            }, labels)
    return fixtures


def main() -> None:
    import tempfile

    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agent-clis-") as tmp:
        for name, fixture in capture_both(Path(tmp)).items():
            path = FIXTURES / f"{name}_request.json"
            path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
            print(f"{path.relative_to(REPO)}: {fixture['hits']} in {fixture['seconds']}s, {fixture['chars']}",
                  file=sys.stderr)


if __name__ == "__main__":
    main()

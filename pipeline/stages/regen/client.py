"""Async OpenAI-compatible chat-completions client with bounded concurrency, retries and outage handling.

:func:`regenerate` sends one request per prompt, at most ``concurrency`` at a time, over one
keep-alive connection pool (aiohttp). Each answer goes to a ``sink`` callback the moment it arrives
(the stage appends it to its resumable log), so whatever was answered survives a kill.

Failures, by kind:

* HTTP 5xx / 429, timeouts, malformed answers: retried with exponential backoff and jitter, up to
  ``max_attempts`` per record, then the record is reported as failed (``on_failure``).
* Connection refused / reset / server gone: an *outage*. It does not use up the record's attempts:
  every worker waits with backoff until the server answers again, ``on_outage(start=True, …)`` is
  called once when it begins and ``on_outage(start=False, …)`` when it ends. An outage longer than
  ``outage_timeout_s`` raises :class:`OutageError`.
* Other HTTP 4xx (a prompt over the context length, a bad parameter): not retried, reported as failed.

``stop()`` (SIGTERM) stops taking new prompts; requests in flight may finish within
``drain_timeout_s``, then the rest are cancelled. ``paused()`` (a callable) holds new requests back.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class OutageError(RuntimeError):
    """The server stayed unreachable for longer than the outage timeout."""


class RetryableError(RuntimeError):
    pass


class PermanentError(RuntimeError):
    pass


class ConnectionLost(RuntimeError):
    """No connection could be made, or it broke mid-request. ``refused``: nothing listens."""

    def __init__(self, text: str, refused: bool) -> None:
        super().__init__(text)
        self.refused = refused


@dataclass(frozen=True)
class ClientConfig:
    url: str  # http://host:port (no trailing /v1)
    model: str | None = None  # None: the first id of GET /v1/models
    concurrency: int = 64
    request_timeout_s: float = 600.0
    max_attempts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    outage_timeout_s: float = 900.0
    drain_timeout_s: float = 8.0
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_tokens, ... (body keys)
    api_key: str | None = None
    more_urls: tuple[str, ...] = ()  # further replicas of the server: requests go to each in turn


@dataclass
class ClientStats:
    sent: int = 0  # HTTP requests issued (including retries)
    answered: int = 0
    failed: int = 0
    retries: int = 0
    outages: int = 0
    outage_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    started: float = field(default_factory=time.monotonic)


Prompt = tuple[str, list[dict[str, Any]]]  # (record id, messages)
Sink = Callable[[dict[str, Any]], None]


def parse_reply(rid: str, messages: list[dict[str, Any]], body: Any, model: str) -> dict[str, Any]:
    """The output record for one chat-completions answer; raises :class:`RetryableError` if malformed."""
    try:
        choice = body["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RetryableError(f"answer without choices[0].message: {str(body)[:200]}") from None
    content = msg.get("content")
    if content is not None and not isinstance(content, str):
        raise RetryableError(f"choices[0].message.content is {type(content).__name__}, not text")
    turn: dict[str, Any] = {"role": "assistant", "content": content or ""}
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        turn["reasoning"] = reasoning
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        out_calls = []
        for c in calls:
            fn = (c or {}).get("function") or {}
            if isinstance(fn.get("name"), str):
                out_calls.append(
                    {
                        "name": fn["name"],
                        "arguments": fn.get("arguments") or "{}",
                        **({"id": c["id"]} if isinstance(c.get("id"), str) else {}),
                    }
                )
        if out_calls:
            turn["tool_calls"] = out_calls
    usage = body.get("usage") or {}
    return {
        "id": rid,
        "messages": [*messages, turn],
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "model": body.get("model") or model,
    }


class Regenerator:
    """One run of requests over a list of prompts (see the module docstring)."""

    def __init__(
        self,
        cfg: ClientConfig,
        sink: Sink,
        on_failure: Callable[[str, str], None] | None = None,
        on_outage: Callable[[bool, str, float], None] | None = None,
        paused: Callable[[], bool] | None = None,
        on_pause: Callable[[bool], None] | None = None,
    ) -> None:
        if cfg.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.cfg = cfg
        self.sink = sink
        self.on_failure = on_failure or (lambda rid, why: None)
        self.on_outage = on_outage or (lambda start, detail, dur: None)
        self.paused = paused or (lambda: False)
        self.on_pause = on_pause or (lambda paused: None)
        self.stats = ClientStats()
        self.abandoned = 0  # requests still in flight when a stop's drain time ran out (asked again on retry)
        self.model = cfg.model
        self._stopping = False
        self._outage_since: float | None = None
        self._outage_detail = ""
        self._endpoints = [u.rstrip("/") + "/v1/chat/completions" for u in (cfg.url, *cfg.more_urls)]
        self._endpoint = self._endpoints[0]
        self._headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self._headers["Authorization"] = f"Bearer {cfg.api_key}"
        self._is_paused = False

    # -- control ------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _backoff(self, attempt: int) -> float:
        base = min(self.cfg.backoff_max_s, self.cfg.backoff_s * (2 ** max(0, attempt - 1)))
        return base * (0.5 + random.random() / 2)

    # -- outage bookkeeping -------------------------------------------------------------------
    def _outage_begin(self, detail: str) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._outage_detail = detail
            self.stats.outages += 1
            self.on_outage(True, detail, 0.0)
        elif time.monotonic() - self._outage_since > self.cfg.outage_timeout_s:
            raise OutageError(
                f"the server at {self.cfg.url} has been unreachable for "
                f"{time.monotonic() - self._outage_since:.0f}s (> {self.cfg.outage_timeout_s:g}s): "
                f"{self._outage_detail}"
            )

    def _outage_end(self) -> None:
        if self._outage_since is not None:
            dur = time.monotonic() - self._outage_since
            self._outage_since = None
            self.stats.outage_s += dur
            self.on_outage(False, self._outage_detail, dur)

    # -- HTTP ---------------------------------------------------------------------------------
    async def _post(self, session: aiohttp.ClientSession, body: bytes) -> Any:
        self.stats.sent += 1
        try:
            # Round robin over the server's replicas (one endpoint: always that one).
            endpoint = self._endpoints[self.stats.sent % len(self._endpoints)]
            async with session.post(endpoint, data=body, headers=self._headers) as resp:
                raw = await resp.read()
                if resp.status == 200:
                    try:
                        return json.loads(raw)
                    except ValueError:
                        raise RetryableError(f"answer is not JSON: {raw[:200]!r}") from None
                text = raw[:300].decode(errors="replace")
                if resp.status in RETRY_STATUS or resp.status >= 500:
                    raise RetryableError(f"HTTP {resp.status}: {text}")
                raise PermanentError(f"HTTP {resp.status}: {text}")
        except (aiohttp.ClientConnectionError, ConnectionError) as exc:
            if isinstance(exc, aiohttp.ServerTimeoutError):
                raise RetryableError(f"timeout: {exc}") from None
            refused = isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError)
            raise ConnectionLost(f"{type(exc).__name__}: {exc}", refused) from None
        except TimeoutError:
            raise RetryableError(f"no answer within {self.cfg.request_timeout_s:g}s") from None

    async def discover_model(self, session: aiohttp.ClientSession) -> str:
        """The served model's id from ``GET /v1/models`` (waiting out an outage like any request)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                async with session.get(
                    self.cfg.url.rstrip("/") + "/v1/models", headers=self._headers
                ) as resp:
                    if resp.status != 200:
                        raise RetryableError(f"GET /v1/models: HTTP {resp.status}")
                    data = (await resp.json(content_type=None)).get("data") or []
                    if not data or not isinstance(data[0].get("id"), str):
                        raise PermanentError(f"GET /v1/models lists no model: {str(data)[:200]}")
                    self._outage_end()
                    return data[0]["id"]
            except (TimeoutError, aiohttp.ClientConnectionError, ConnectionError) as exc:
                self._outage_begin(f"{type(exc).__name__}: {exc}")
            except RetryableError:
                if attempt >= self.cfg.max_attempts:
                    raise
            if self._stopping:
                raise asyncio.CancelledError
            await asyncio.sleep(self._backoff(attempt))

    async def _one(self, session: aiohttp.ClientSession, rid: str, messages: list[dict[str, Any]]) -> None:
        body = json.dumps(
            {"model": self.model, "messages": messages, **self.cfg.sampling, "stream": False},
            ensure_ascii=False,
        ).encode()
        attempt = 0  # attempts that count: not those lost to an outage
        waits = 0
        while True:
            try:
                answer = await self._post(session, body)
                rec = parse_reply(rid, messages, answer, self.model or "")
                self._outage_end()
                self.stats.answered += 1
                self.stats.prompt_tokens += rec["prompt_tokens"]
                self.stats.completion_tokens += rec["completion_tokens"]
                self.sink(rec)
                return
            except ConnectionLost as exc:
                waits += 1
                if not exc.refused and waits == 1:
                    continue  # a keep-alive connection the server had just closed: one immediate retry
                self._outage_begin(str(exc))
                await asyncio.sleep(self._backoff(waits))
                continue
            except PermanentError as exc:
                self._outage_end()
                self.stats.failed += 1
                self.on_failure(rid, str(exc))
                return
            except RetryableError as exc:
                self._outage_end()
                attempt += 1
                if attempt >= self.cfg.max_attempts:
                    self.stats.failed += 1
                    self.on_failure(rid, f"gave up after {attempt} attempts: {exc}")
                    return
                self.stats.retries += 1
                await asyncio.sleep(self._backoff(attempt))

    async def _worker(self, session: aiohttp.ClientSession, it: Iterable[Prompt]) -> None:
        for rid, messages in it:
            while self.paused() and not self._stopping:
                await asyncio.sleep(0.2)
            if self._stopping:
                return
            self.stats.in_flight += 1
            try:
                await self._one(session, rid, messages)
            finally:
                self.stats.in_flight -= 1

    async def _pause_watch(self) -> None:
        while True:
            p = self.paused()
            if p and not self._is_paused and self.stats.in_flight == 0:
                self._is_paused = True
                self.on_pause(True)
            elif not p and self._is_paused:
                self._is_paused = False
                self.on_pause(False)
            await asyncio.sleep(0.2)

    async def run(
        self,
        prompts: Sequence[Prompt],
        tick: Callable[[ClientStats], Awaitable[None] | None] | None = None,
        tick_s: float = 1.0,
    ) -> ClientStats:
        """Send every prompt; returns the stats. Raises :class:`OutageError` on a long outage."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        conn = aiohttp.TCPConnector(
            limit=self.cfg.concurrency,
            limit_per_host=self.cfg.concurrency,
            force_close=False,
            enable_cleanup_closed=True,
        )
        async with aiohttp.ClientSession(
            timeout=timeout, connector=conn, trust_env=False, auto_decompress=False
        ) as session:
            if self.model is None:
                self.model = await self.discover_model(session)
            it = iter(prompts)
            workers = [
                asyncio.create_task(self._worker(session, it))
                for _ in range(min(self.cfg.concurrency, max(1, len(prompts))))
            ]
            side = [asyncio.create_task(self._pause_watch())]
            if tick is not None:
                side.append(asyncio.create_task(self._ticker(tick, tick_s)))
            try:
                await self._wait(workers)
                self.abandoned = self.stats.in_flight if self._stopping else 0
            finally:
                for t in workers + side:
                    t.cancel()
                await asyncio.gather(*workers, *side, return_exceptions=True)
            if tick is not None:
                r = tick(self.stats)
                if asyncio.iscoroutine(r):
                    await r
        return self.stats

    async def _wait(self, workers: list[asyncio.Task]) -> None:
        pending = set(workers)
        drain_deadline: float | None = None
        while pending:
            done, pending = await asyncio.wait(pending, timeout=0.2, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if self._stopping:
                drain_deadline = drain_deadline or time.monotonic() + self.cfg.drain_timeout_s
                if time.monotonic() > drain_deadline:
                    return

    async def _ticker(self, tick: Callable[[ClientStats], Awaitable[None] | None], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            r = tick(self.stats)
            if asyncio.iscoroutine(r):
                await r

"""Load and faults on a real `python -m llmcourse serve` process (issue 45), on loopback, bounded (about 20-40 s).

First, 40 concurrent requests on both routes, streaming or not, a third of the streams cut by their client after
two events: every other request completes with its full length, and every KV block is back in the pool at once.
Then SIGTERM with 24 requests in flight: each stream ends with `data: [DONE]` (after an error event if it was cut
short), each plain request gets its answer or a JSON 503, none hangs, the process exits 0, and its log holds
no traceback and no error.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

STREAMS, CUT_EVERY, PLAIN, CHATS = 24, 3, 10, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client: httpx.AsyncClient, route: str, body: dict, cut_after: int | None = None) -> list[str]:
    """The stream's data lines (all of them, or the first `cut_after` when the client goes away then)."""
    events = []
    async with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append(line)
                if cut_after is not None and len(events) == cut_after:
                    return events  # leaving the block closes the connection mid-stream
    return events


def text_of(events: list[str]) -> tuple[str, list]:
    chunks = [json.loads(e[5:]) for e in events if e != "data: [DONE]"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    return "".join(c["choices"][0].get("text", "") for c in chunks if c.get("choices")), finish


async def load(url: str) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        jobs = []
        for i in range(STREAMS):
            body = {"prompt": "ROMEO:", "max_tokens": rng.randint(8, 40), "ignore_eos": True, "seed": i}
            jobs.append(("stream", body, stream(client, "/v1/completions", body, 2 if i % CUT_EVERY == 0 else None)))
        for i in range(PLAIN):
            body = {"prompt": "JULIET:", "max_tokens": rng.randint(4, 30), "ignore_eos": True, "seed": i}
            jobs.append(("plain", body, client.post("/v1/completions", json=body)))
        for i in range(CHATS):
            body = {"messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": 12, "seed": i}
            jobs.append(("chat", body, client.post("/v1/chat/completions", json=body)))
        results = await asyncio.wait_for(asyncio.gather(*(job for _, _, job in jobs)), 45)
        for i, ((kind, body, _), got) in enumerate(zip(jobs, results)):
            if kind == "stream" and i % CUT_EVERY != 0:
                assert got[-1] == "data: [DONE]" and text_of(got)[1] == ["length"], got[-3:]
            elif kind == "plain":
                assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == body["max_tokens"]
            elif kind == "chat":
                assert got.status_code == 200 and got.json()["choices"][0]["message"]["role"] == "assistant"


async def load_then_sigterm(url: str, process: subprocess.Popen) -> None:
    long = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        streams = [asyncio.ensure_future(stream(client, "/v1/completions", {**long, "seed": i})) for i in range(16)]
        plains = [asyncio.ensure_future(client.post("/v1/completions", json={**long, "seed": i})) for i in range(8)]
        deadline = time.monotonic() + 20
        while (await client.get("/health")).json()["running"] < 8:  # a full batch decoding, the rest waiting
            assert time.monotonic() < deadline, "the requests did not start"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        streamed = await asyncio.wait_for(asyncio.gather(*streams), 20)  # none hangs
        answered = await asyncio.wait_for(asyncio.gather(*plains), 20)
        print(f"\nSIGTERM with 24 requests in flight: all answered within {time.monotonic() - start:.2f} s")
    cut = 0
    for events in streamed:
        assert events[-1] == "data: [DONE]", events[-3:]
        if "error" in events[-2]:
            error = json.loads(events[-2][5:])["error"]
            assert "shut down" in error["message"] and error["type"] == "server_error"
            cut += 1
        else:
            assert text_of(events)[1] == ["length"]
    statuses = sorted(r.status_code for r in answered)
    for r in answered:
        assert r.status_code in (200, 503) and r.headers["content-type"] == "application/json", r.text
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "server_busy"
    assert cut > 0 and 503 in statuses, "SIGTERM came while requests were in flight"


def test_load_with_disconnects_then_sigterm_mid_load():
    port = free_port()
    command = [sys.executable, "-m", "llmcourse", "serve", "--port", str(port), "--shutdown-grace", "0.3",
               "--max-num-seqs", "8"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        asyncio.run(load(url))
        deadline = time.monotonic() + 2
        while (health := httpx.get(url + "/health").json())["free_blocks"] != health["num_blocks"]:
            assert time.monotonic() < deadline, f"blocks not back in the pool: {health}"
            time.sleep(0.02)
        assert health["running"] == health["waiting"] == 0
        asyncio.run(load_then_sigterm(url, process))
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
    log = process.stderr.read()
    assert "Traceback" not in log and "ERROR" not in log, log

"""The chat page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven over the
DevTools protocol with aiohttp's websocket client), against ``sluice serve`` on the tiny model
with an API key: a wrong key shows the server's refusal, the right one lists the model; a typed
message gets a streamed answer (the same text the API gives for the same greedy request) with
TTFT and tokens/s; a second, long answer is stopped mid-stream, and the server is idle after it
(the stop aborted the engine request).

Chromium is installed by ``make setup`` (``apt-get install chromium`` as root); without it this
test fails saying so, it is never skipped.
"""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.serve import Serve, wait_idle
from tests.tiny_model import write_tiny_folder

pytestmark = pytest.mark.timeout(300)
KEY = "sk-page"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run")


def chromium_path() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.fail("Debian's chromium is missing: run `make setup` (it runs `apt-get install -y chromium` as root) "
                    "or install it by hand", pytrace=False)
    return path


class Page:
    """One tab, driven over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.02)
        raise AssertionError(f"not within {timeout}s: {what}")

    async def type_into(self, element_id: str, text: str) -> None:
        await self.js(f"document.getElementById({json.dumps(element_id)}).focus()")
        await self.call("Input.insertText", text=text)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_page")
    s = Serve(write_tiny_folder(root / "tiny"), root / "serve.log", api_key=KEY,
              overrides="max_total_seq_length=1024;max_num_sequence=4").wait_ready()
    yield s
    s.stop()


@pytest.fixture
async def page(tmp_path):
    profile = tmp_path / "profile"
    proc = subprocess.Popen([chromium_path(), *CHROMIUM_FLAGS, "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            await asyncio.sleep(0.1)
        port = active.read_text().split()[0]
        async with aiohttp.ClientSession() as session:
            targets = await (await session.get(f"http://127.0.0.1:{port}/json/list")).json()
            tab = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _text(expr: str) -> str:
    return f"(document.querySelector({json.dumps(expr)}) || {{}}).textContent"


async def test_chat_page_streams_an_answer_and_stops_one(serve, page):
    await page.call("Page.navigate", url=serve.url + "/")
    await page.until("document.readyState === 'complete' && !!document.getElementById('model')", "the page")
    status = await page.until("(s => s.includes('Could not list') && s)(document.getElementById('status')"
                              ".textContent)", "the refusal without a key")
    assert "missing API key" in status
    await page.type_into("api-key", "sk-wrong")
    await page.js("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    await page.until(f"{_text('#status')}.includes('incorrect API key')", "the refusal of a wrong key")
    await page.js("document.getElementById('api-key').value = ''")
    await page.type_into("api-key", KEY)
    await page.js("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    model = await page.until("document.getElementById('model').value", "the model list")
    assert model == serve.model

    # a short greedy answer: the same text as the API's
    await page.js("for (const [id, v] of [['temperature', '0'], ['max-tokens', '8']]) "
                  "document.getElementById(id).value = v;"
                  "document.getElementById('extra').value = '{\"ignore_eos\": true}'")
    await page.type_into("prompt", "w1 w2 w3")
    await page.js("document.getElementById('send').click()")
    done = await page.until("(document.querySelector('.msg.assistant') || {dataset: {}}).dataset.done",
                            "the first answer")
    assert done == "finished: length"
    shown = (await page.js(_text(".msg.assistant .body"))).strip()
    stats = await page.js(_text(".msg.assistant .stats"))
    assert "TTFT" in stats and "tokens/s" in stats and "8 tokens" in stats, stats
    api = serve.post("/v1/chat/completions", json={"model": model,
                                                   "messages": [{"role": "user", "content": "w1 w2 w3"}],
                                                   "temperature": 0, "top_p": 1, "max_tokens": 8,
                                                   "ignore_eos": True}).json()
    assert shown == api["choices"][0]["message"]["content"].strip() and shown

    # a long answer (900 tokens: about a second here), stopped as soon as its first words show: the
    # page itself clicks Stop on that change, so no DevTools round trip can come too late
    await page.js("document.getElementById('max-tokens').value = '900'")
    await page.js("""(() => {
        const seen = new MutationObserver(() => {
            const answers = document.querySelectorAll('.msg.assistant');
            if (answers.length === 2 && answers[1].querySelector('.body').textContent.trim()) {
                seen.disconnect();
                window.stoppedAfter = answers[1].querySelector('.body').textContent;
                document.getElementById('stop').click();
            }
        });
        seen.observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    })()""")
    await page.type_into("prompt", "w4")
    await page.js("document.getElementById('send').click()")
    done = await page.until("document.querySelectorAll('.msg.assistant')[1].dataset.done", "the stop")
    assert done == "stopped"
    stats = await page.js("document.querySelectorAll('.msg.assistant')[1].querySelector('.stats').textContent")
    tokens = int(re.search(r"(\d+) tokens(?!/)", stats)[1])
    assert 0 < tokens < 900, stats
    assert (await page.js("window.stoppedAfter")).strip()           # it had begun streaming
    assert await page.js("document.getElementById('send').disabled") is False
    await asyncio.to_thread(wait_idle, serve, 30)      # the engine request was aborted, nothing leaked

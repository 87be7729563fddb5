"""The chat page in real headless Chromium (Debian's `chromium`, driven by Playwright)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time

import pytest
from aiohttp.test_utils import TestServer
from conftest import slow_down_steps

from streamengine import AsyncEngine, EngineConfig
from streamengine.server import create_app
from streamengine.server.config import ServerConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.path.exists("/usr/bin/chromium"):
    CHROMIUM = "/usr/bin/chromium"
if CHROMIUM is None:
    pytest.skip("no chromium binary found (apt-get install chromium)", allow_module_level=True)
async_api = pytest.importorskip("playwright.async_api", reason="the playwright package is not installed")

ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return AsyncEngine(EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=NUM_BLOCKS, max_num_seqs=8))


@contextlib.asynccontextmanager
async def browser_page(engine, **options):
    app = create_app(engine, ServerConfig(model_name="tiny", **options))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with async_api.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1200, "height": 800})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(f"http://127.0.0.1:{server.port}/")
                yield page, errors
            finally:
                await browser.close()
    finally:
        await server.close()


async def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["num_requests"] or engine.stats()["num_free_blocks"] != NUM_BLOCKS:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {engine.stats()}")
        await asyncio.sleep(0.05)


async def test_chat_streams_and_stop_aborts(engine, monkeypatch):
    # Each step takes 20 ms more, so the 900-token reply outlasts the clicks below on any
    # machine (the tiny model alone can finish it before Stop is visible).
    slow_down_steps(monkeypatch, engine, 0.02)
    async with browser_page(engine) as (page, errors):
        await page.wait_for_selector("#conn-text:text('connected')", timeout=15_000)
        assert await page.text_content("#model") == "tiny"
        # a random model may pick EOS at any time; keep it talking until Stop
        await page.evaluate("window.streamengine.extraParams = {ignore_eos: true}")
        await page.fill("#max-tokens", "900")
        await page.fill("#system", "Be terse.")
        await page.fill("#input", "Hello there, tell me everything.")
        await page.click("#send")

        reply = page.locator(".msg.assistant .bubble").last
        await page.wait_for_function(
            "document.querySelector('.msg.assistant .bubble').textContent.length > 0", timeout=15_000
        )
        first = len(await reply.text_content())
        await page.wait_for_function(
            f"document.querySelector('.msg.assistant .bubble').textContent.length > {first}", timeout=15_000
        )  # it keeps growing: streamed, not delivered at the end
        assert await page.is_visible("#stop") and not await page.is_visible("#send")
        await page.click("#stop")
        finish = page.locator(".msg.assistant [data-stat=finish]")
        await finish.wait_for(timeout=15_000)
        assert await finish.text_content() == "stopped"
        assert await page.is_visible("#send") and not await page.is_visible("#stop")

        meta = page.locator(".msg.assistant .meta")
        assert "ms" in await meta.locator("[data-stat=ttft]").text_content()
        tokens = int((await meta.locator("[data-stat=tokens]").text_content()).split()[0])
        assert 1 < tokens < 900
        assert "tokens" in await meta.locator("[data-stat=cached]").text_content()
        await wait_idle(engine)  # Stop really aborted the request and freed its blocks

        # the KV map is fed by the server and accounts for every block
        await page.wait_for_function(
            "['free','cached','used','shared'].reduce((s, k) => s + +document.getElementById('kv-' + k).textContent, 0)"
            f" === {NUM_BLOCKS}", timeout=10_000,
        )
        assert "96 blocks" in await page.text_content("#kv-summary")
        assert errors == []
        if shot_dir := os.environ.get("STREAMENGINE_SCREENSHOT_DIR"):
            await page.screenshot(path=os.path.join(shot_dir, "chat_wide.png"))

        # narrow screen: no horizontal scrolling, the KV panel moves below the chat
        await page.set_viewport_size({"width": 380, "height": 800})
        assert await page.evaluate("document.documentElement.scrollWidth") <= 380
        chat_box = await page.locator(".chat").bounding_box()
        kv_box = await page.locator(".kv").bounding_box()
        assert kv_box["y"] >= chat_box["y"] + chat_box["height"]
        if shot_dir:
            await page.screenshot(path=os.path.join(shot_dir, "chat_narrow.png"), full_page=True)


async def test_page_asks_for_the_api_key(engine):
    async with browser_page(engine, api_key="page-key") as (page, errors):
        dialog = page.locator("#key-dialog")
        await dialog.wait_for(state="visible", timeout=10_000)
        await page.fill("#key-input", "wrong-key")
        await page.click("#key-form button")
        # the server closes the socket with 4001 and the page asks again
        await page.wait_for_selector("#conn-text:text('API key refused')", timeout=10_000)
        await dialog.wait_for(state="visible", timeout=10_000)
        await page.fill("#key-input", "page-key")
        await page.click("#key-form button")
        await page.wait_for_selector("#conn-text:text('connected')", timeout=10_000)
        await page.fill("#max-tokens", "3")
        await page.fill("#input", "Hi")
        await page.press("#input", "Enter")
        await page.locator(".msg.assistant [data-stat=finish]").wait_for(timeout=15_000)
        assert errors == []

"""The chat page (llmcourse/serving/static/chat.html) driven in headless Chromium against the real server.

Debian's chromium and chromedriver are needed: `.ci/run` installs them, so under CI (env CI set) their absence
fails the test rather than skipping it. SCREENSHOTS=1 saves the page at 1400 and 500 px to /tmp/w/.
"""

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model
from llmcourse.serving.api_server import ServerThread, build_app
from llmcourse.serving.llm_engine import LLMEngine

try:  # requirements.txt installs selenium; without it the browser fixture skips (fails under CI)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SHOTS = Path("/tmp/w")
TIMEOUT = 30  # seconds for a reply of a few dozen tokens on a busy 2-core machine


def need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run the browser test (.ci/run installs chromium and chromium-driver)")
        pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    need(all(os.path.exists(p) for p in (CHROMIUM, CHROMEDRIVER)), f"{CHROMIUM} or {CHROMEDRIVER} missing")
    need(webdriver is not None, "selenium is not installed (requirements.txt)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def serve(name: str, **options):
    """A server on the bundled model `name`, in this process (`options`: build_app's). -> (its LLMEngine, server)."""
    model, tokenizer = load_model(name, device="cpu"), load_tokenizer(name)
    engine = LLMEngine(model, tokenizer=tokenizer)
    return engine, ServerThread(build_app(engine, tokenizer, name, **options))


@pytest.fixture(scope="module")
def llama():
    engine, server = serve("llama-shakespeare")
    with server:
        yield server.url, engine


@pytest.fixture(scope="module")
def gpt2():
    engine, server = serve("gpt2-shakespeare")
    with server:
        yield server.url, engine


def post(url: str, route: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def open_page(driver, url: str, width: int, loaded: bool = True) -> None:
    driver.set_window_size(width, 900)
    driver.get(url + "/")
    if loaded:  # wait for GET /v1/models's answer
        WebDriverWait(driver, TIMEOUT).until(lambda d: d.find_element("id", "model-name").text)


def set_field(driver, field: str, value) -> None:
    """Type into a settings box (opening the settings first, folded away on a narrow page)."""
    driver.execute_script("document.getElementById('settings').open = true")
    box = driver.find_element("id", field)
    box.clear()
    box.send_keys(str(value))


def ask(driver, text: str) -> dict:
    """Type `text`, press Enter, wait for the streamed reply to end. -> the newest reply's text, stats, errors."""
    before = len(driver.find_elements("css selector", ".reply"))
    prompt = driver.find_element("id", "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)
    WebDriverWait(driver, TIMEOUT).until(
        lambda d: (
            len(d.find_elements("css selector", ".reply")) > before
            and d.find_elements("css selector", ".reply")[-1].get_attribute("data-done") == "true"
        )
    )
    return driver.execute_script("""
        const box = [...document.querySelectorAll('.msg.assistant')].pop();
        return {text: box.querySelector('.reply').textContent, stats: box.querySelector('.stats').textContent,
                errors: [...box.querySelectorAll('.error')].map(e => e.textContent),
                tokens: box.querySelectorAll('.reply .tok').length};""")


def fits(driver) -> bool:
    return driver.execute_script("return document.documentElement.scrollWidth <= document.documentElement.clientWidth")


def screenshot(driver, name: str) -> None:
    if os.environ.get("SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SHOTS / name))


def whole(url: str, route: str, **body) -> str:
    """The text the server answers `body` with, not streamed."""
    status, answer = post(url, route, body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_chat_streams_the_reply_the_server_gives_whole(browser, llama):
    url, _ = llama
    open_page(browser, url, 1400)
    assert browser.find_element("id", "mode").get_attribute("value") == "chat"
    settings = {"temperature": 0, "top_p": 0.9, "max_tokens": 24, "seed": 7}
    for field, value in settings.items():
        set_field(browser, field.replace("_", "-"), value)
    reply = ask(browser, "Who art thou?")
    assert reply["text"].strip() and not reply["errors"], reply
    assert re.search(r"\d+ tokens? · first token \d+ ms · [\d.]+ tokens/s", reply["stats"]), reply["stats"]
    first = [{"role": "user", "content": "Who art thou?"}]
    assert reply["text"] == whole(url, "/v1/chat/completions", model="llama-shakespeare", messages=first, **settings)

    # Each token carries its probability: hovering one shows it as a % and the alternatives with theirs.
    token = browser.find_elements("css selector", ".reply .tok")[1]
    ActionChains(browser).move_to_element(token).perform()
    tip = browser.find_element("id", "tip")
    assert tip.is_displayed()
    assert re.search(r"probability \d+(\.\d+)?%", tip.text), tip.text
    assert len(tip.find_elements("css selector", "tr")) == 5, tip.text  # top_logprobs: 5
    p = browser.execute_script("return Math.exp(arguments[0].tokens[0].logprob)", token)
    assert 0 < p <= 1 and f"{100 * p:.1f}%" in tip.text
    screenshot(browser, "chat_1400.png")

    # A second turn sends the whole conversation: the page's history is the server's transcript.
    second = ask(browser, "And whence?")
    assert second["text"].strip() and not second["errors"], second
    both = first + [{"role": "assistant", "content": reply["text"]}, {"role": "user", "content": "And whence?"}]
    assert second["text"] == whole(url, "/v1/chat/completions", model="llama-shakespeare", messages=both, **settings)


def test_narrow_page_fits_and_sends(browser, llama):
    url, _ = llama
    for width in (400, 500):
        open_page(browser, url, width)
        assert fits(browser), f"horizontal scroll at {width} px"
        for target in ("send", "stop", "new-chat", "prompt", "mode", "temperature"):
            assert browser.find_element("id", target).size["height"] >= 40, f"#{target} under 40 px at {width} px"
    set_field(browser, "max-tokens", 16)
    set_field(browser, "temperature", 0)  # greedy: a sampled reply may end at once (EOS first), and have no text
    browser.execute_script("document.getElementById('settings').open = false")
    reply = ask(browser, "Speak, I pray thee.")
    assert reply["text"] and reply["tokens"] >= 1 and "first token" in reply["stats"], reply
    assert fits(browser), "horizontal scroll at 500 px after a reply"
    screenshot(browser, "chat_500.png")


def test_stop_aborts_the_request(browser, gpt2):
    url, engine = gpt2  # greedy, gpt2-shakespeare continues "ROMEO:" for 200 tokens (llama-shakespeare soon ends)
    step = engine.step

    def slow_step():  # a slow model: the reply is still streaming when Stop is pressed
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    try:
        open_page(browser, url, 1400)
        set_field(browser, "temperature", 0)
        set_field(browser, "max-tokens", 200)
        browser.find_element("id", "prompt").send_keys("ROMEO:", Keys.ENTER)
        WebDriverWait(browser, TIMEOUT, poll_frequency=0.02).until(
            lambda d: d.find_elements("css selector", ".reply .tok")
        )
        browser.find_element("id", "stop").click()
        WebDriverWait(browser, 5).until(lambda d: d.find_element("css selector", ".reply").get_attribute("data-done"))
        assert "stopped by you" in browser.find_element("css selector", ".stats").text
        assert browser.find_element("id", "send").is_enabled() and not browser.find_element("id", "stop").is_enabled()
        deadline = time.monotonic() + 10  # the server sees the disconnect and aborts the request
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.has_unfinished()
    finally:
        del engine.step


def test_model_without_chat_template_opens_in_complete_mode(browser, gpt2):
    url, _ = gpt2
    open_page(browser, url, 1400)
    assert browser.find_element("id", "mode").get_attribute("value") == "complete"
    assert "chat template" in browser.find_element("id", "mode-note").text
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 16)
    reply = ask(browser, "ROMEO:")
    assert reply["text"] and not reply["errors"], reply
    top_p = float(browser.find_element("id", "top-p").get_attribute("value"))
    assert reply["text"] == whole(
        url, "/v1/completions", model="gpt2-shakespeare", prompt="ROMEO:", temperature=0, top_p=top_p, max_tokens=16
    )


def test_server_errors_are_shown(browser, llama):
    url, _ = llama
    open_page(browser, url, 1400)
    set_field(browser, "max-tokens", 0)
    reply = ask(browser, "Hello?")
    status, body = post(
        url,
        "/v1/chat/completions",
        {"model": "llama-shakespeare", "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 0},
    )
    assert status == 400, body
    assert reply["errors"] == [f"Error 400: {body['error']['message']}"], reply
    assert reply["text"] == ""


def test_api_key_is_asked_for_and_sent(browser):
    _, server = serve("llama-shakespeare", api_key="open-sesame")
    with server:
        open_page(browser, server.url, 500, loaded=False)
        set_field(browser, "max-tokens", 8)
        set_field(browser, "temperature", 0)  # greedy: a sampled reply may end at once (EOS first), and have no text
        refused = ask(browser, "Who goes there?")  # without the key: 401, shown, and the key's box focused
        assert len(refused["errors"]) == 1 and refused["errors"][0].startswith("Error 401: "), refused
        assert browser.switch_to.active_element.get_attribute("id") == "api-key"
        browser.find_element("id", "api-key").send_keys("open-sesame")
        reply = ask(browser, "Who goes there?")
        assert reply["text"] and not reply["errors"], reply

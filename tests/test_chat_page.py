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

pytestmark = pytest.mark.usefixtures("server_log")  # no traceback or error in the server's log (tests/server_log.py)
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
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for test_favicon_is_served
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


def close_settings(driver) -> None:
    driver.execute_script("document.getElementById('settings').open = false")


def in_view(driver, element) -> bool:
    """Whether `element` is wholly inside the conversation's visible area (#messages scrolls, the page does not)."""
    return driver.execute_script(
        """const r = arguments[0].getBoundingClientRect(),
                 m = document.getElementById('messages').getBoundingClientRect();
           return r.height > 0 && r.top >= m.top - 1 && r.bottom <= m.bottom + 1;""",
        element,
    )


def test_long_conversation_forgets_the_oldest_turns(browser, llama):
    """The bundled model's context is 256 tokens: four short turns fill it. Every later turn is still answered: the
    page forgets the oldest turns, as `python -m llmcourse chat` does, and says so in a note."""
    url, _ = llama
    open_page(browser, url, 400)  # a phone's width: the notes fit it too
    assert browser.find_element("id", "max-tokens").get_attribute("value") == "64"  # a quarter of the context
    settings = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 64, "seed": 11}
    set_field(browser, "seed", settings["seed"])
    close_settings(browser)
    lines = [
        "Good morrow, sir. How fares thy master?",
        "Where is the duke this night?",
        "What news from Verona, good friend?",
        "Wherefore dost thou weep, sweet lady?",
        "Speak, what tidings bring'st thou from the court?",
        "Is the king well? I pray thee, tell me true.",
        "Then let us go, and quickly, to the gate.",
        "Hark! Who knocks so late upon the door?",
        "I will not stay; the night is cold and dark.",
        "Farewell, and may the heavens keep thee safe.",
    ]
    for i, line in enumerate(lines):
        reply = ask(browser, line)
        assert not reply["errors"], (i, reply)  # before: from the fifth turn, "Error 400: ... do not fit"
        used = re.search(r"context (\d+) of 256 tokens", reply["stats"])
        assert used and int(used[1]) <= 256, (i, reply)
    notes = browser.find_elements("css selector", "#messages .note")
    assert len(notes) >= 3, "a note for each turn that forgot older ones"
    assert re.fullmatch(
        r"The conversation no longer fits the model's context \(256 tokens\) with 64 tokens for the reply "
        r"\(max tokens\): its (oldest turn is|\d+ oldest turns are) forgotten, faded above; the model no longer "
        r"sees (it|them)\.",
        notes[-1].text,
    ), notes[-1].text
    assert in_view(browser, notes[-1]) or in_view(browser, browser.find_elements("css selector", ".msg")[-1])
    forgotten = browser.find_elements("css selector", ".msg.forgotten")
    assert forgotten and len(forgotten) % 2 == 0  # whole turns: a question and its reply
    assert float(forgotten[0].value_of_css_property("opacity")) < 1
    assert fits(browser), "horizontal scroll at 400 px after the notes"
    screenshot(browser, "chat_forgotten_400.png")

    # What the page sent last is what it still remembers: the newest reply is the server's to that conversation.
    remembered = browser.execute_script("return history.map(({role, content}) => ({role, content}))")
    asked = [m["content"] for m in remembered[::2]]
    assert asked == [line for line in lines if line in asked] and asked[0] != lines[0], asked  # the newest kept
    assert remembered[-1]["content"] == reply["text"] and asked[-1] == lines[-1]
    faded = [m.text for m in browser.find_elements("css selector", ".msg.user.forgotten")]
    assert faded == lines[: len(faded)] and not set(faded) & set(asked)
    messages = remembered[:-1]
    assert reply["text"] == whole(url, "/v1/chat/completions", model="llama-shakespeare", messages=messages, **settings)


def test_a_message_too_long_alone_forgets_nothing(browser, llama):
    """When even the new message alone does not fit, forgetting cannot help: the turns are kept, the error shown."""
    url, _ = llama
    open_page(browser, url, 1400)
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 16)
    first = ask(browser, "Who art thou?")
    assert not first["errors"], first
    refused = ask(browser, "Speak on. " * 60)
    assert len(refused["errors"]) == 1 and "the model's context is 256 tokens" in refused["errors"][0], refused
    assert not browser.find_elements("css selector", ".note, .msg.forgotten")
    assert browser.execute_script("return history.length") == 2


def test_new_bubbles_and_errors_scroll_into_view(browser, llama):
    """Before: the view followed only when the new content was under 120 px, so at a phone's size a new turn and an
    error bubble stayed below the visible area (Enter seemed to do nothing)."""
    url, _ = llama
    open_page(browser, url, 400)
    browser.set_window_size(400, 640)
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 40)
    close_settings(browser)
    for line in ("Good morrow, sir. How fares thy master?", "What news from Verona, good friend?", "Speak on."):
        ask(browser, line)
        newest = browser.find_elements("css selector", ".msg.assistant .stats")[-1]
        assert in_view(browser, newest), f"the reply to {line!r} is out of view"
    overflows = "const m = document.getElementById('messages'); return m.scrollHeight > m.clientHeight"
    assert browser.execute_script(overflows), "too little to scroll: the test would prove nothing"
    set_field(browser, "max-tokens", 0)  # refused by the server: 400
    close_settings(browser)
    refused = ask(browser, "Hello?")
    assert refused["errors"], refused
    error = browser.find_elements("css selector", ".msg.assistant .error")[-1]
    assert in_view(browser, error), "the error bubble is out of view"
    screenshot(browser, "chat_error_400.png")


def test_favicon_is_served(browser, llama):
    url, _ = llama
    with urllib.request.urlopen(url + "/favicon.ico", timeout=TIMEOUT) as response:
        assert response.status == 200 and response.headers["content-type"].startswith("image/")
        assert response.read().lstrip().startswith(b"<svg")
    browser.get_log("browser")  # empties the console's log
    open_page(browser, url, 1400)
    icon = browser.execute_script(
        "return fetch('/favicon.ico').then(r => [r.status, r.headers.get('content-type')])"
    )  # the page's <link rel="icon">: the same URL
    assert icon[0] == 200 and icon[1].startswith("image/"), icon
    time.sleep(0.5)  # the browser asks for the icon after the page has loaded
    failed = [e["message"] for e in browser.get_log("browser") if "404" in e["message"] or "favicon" in e["message"]]
    assert not failed, failed

"""The chat page in a real browser: headless Chromium, driven by Selenium, against a real `pagellm serve` of a
tiny LLaVA (a vision model) that needs an API key. The page asks for the key when the API answers 401,
lists the model, streams a reply token by token, keeps a second turn in the same conversation, sends an
attached image, stops a stream mid-way, regenerates, and keeps conversations across a reload; a
reasoning model's thinking and tool calls show apart from the answer.

Skipped, with the reason, where selenium, Chromium or chromedriver is missing (Debian: `apt-get install
chromium chromium-driver`). `PAGELLM_UPDATE_SCREENSHOT=1` writes the page to docs/images/chat-page.png."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest
from server_harness import ServerProcess
from tiny_vlm import images, make_tiny_llava

ROOT = Path(__file__).parents[2]
SCREENSHOT = ROOT / "docs" / "images" / "chat-page.png"
KEY = "sk-browser-test"
MODEL = "tiny-vlm"
WAIT_S = 60


def _browser_paths() -> tuple[str, str] | str:
    """(chromium, chromedriver), or why the test cannot run."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    candidates = ["/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser")]
    browser = next((c for c in candidates if c and os.path.exists(c)), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return "Chromium or chromedriver is not installed (Debian: apt-get install chromium chromium-driver)"
    return browser, driver


PATHS = _browser_paths()
pytestmark = pytest.mark.skipif(isinstance(PATHS, str), reason=str(PATHS))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_llava(tmp_path_factory.mktemp("web-ui-llava"))
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512"]
    args += ["--num-kv-blocks", "128", "--limit-mm-per-prompt", '{"image": 2}']
    log = tmp_path_factory.mktemp("web-ui-log") / "serve.log"
    process = ServerProcess(model, args, log, env={"PAGELLM_API_KEY": KEY})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, chromedriver = PATHS
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    profile = tmp_path_factory.mktemp("chromium-profile")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,800",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    service = Service(executable_path=chromedriver, log_output=str(profile / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    yield driver
    driver.quit()


def wait_for(driver, condition, message: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: condition(d), message)


def by_id(driver, name: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


# read in one script call: the page re-renders the streaming message on every chunk, so a WebElement
# found a moment earlier may already be gone
LAST_REPLY = """
const all = document.querySelectorAll('.message.assistant');
const m = all[all.length - 1];
return {count: all.length, state: m ? m.dataset.state : null,
        content: m ? m.querySelector('.content').textContent : '', text: m ? m.innerText : ''};
"""


def last_reply(driver) -> dict:
    """The number of assistant messages, and the last one's state, answer text and whole text."""
    return driver.execute_script(LAST_REPLY)


def set_field(driver, name: str, value: str) -> None:
    """Type into a field and fire `change`, as the page saves its settings on change."""
    field = by_id(driver, name)
    field.clear()
    field.send_keys(value)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def open_page(driver, url: str, fresh: bool = True) -> None:
    """Load the page and give it the key when it asks (it lists the models at once, and that answers 401)."""
    driver.get(url)
    if fresh:
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")
        driver.get(url)
    dialog = by_id(driver, "key-dialog")
    if fresh or not driver.execute_script("return sessionStorage.getItem('pagellm.chat.apiKey')"):
        wait_for(driver, lambda d: dialog.is_displayed(), "the API key dialog did not open")
        by_id(driver, "key-input").send_keys(KEY)
        by_id(driver, "key-save").click()
    wait_for(driver, lambda d: by_id(d, "model").get_attribute("value") == MODEL, "no model listed")


@contextlib.contextmanager
def slow_link(driver):
    """A slow link (about 2 KB/s down) for the block: each SSE chunk is a few hundred bytes, so a stream of
    a tiny model, which is done in a blink on localhost, arrives over seconds, a few tokens at a time."""
    driver.set_network_conditions(offline=False, latency=5, download_throughput=2048, upload_throughput=65536)
    try:
        yield
    finally:
        driver.delete_network_conditions()


def send(driver, text: str) -> None:
    by_id(driver, "prompt").send_keys(text)
    by_id(driver, "send").click()


def wait_done(driver, count: int) -> dict:
    """The `count`th assistant message, once its stream has ended."""
    wait_for(driver, lambda d: last_reply(d)["count"] == count, f"no assistant message {count}")
    wait_for(driver, lambda d: last_reply(d)["state"] != "streaming", "the stream did not end")
    return last_reply(driver)


def test_the_page_asks_for_the_api_key_then_lists_the_model(server, driver):
    driver.get(server.url)
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(server.url)
    dialog = by_id(driver, "key-dialog")
    wait_for(driver, lambda d: dialog.is_displayed(), "the API key dialog did not open on 401")
    by_id(driver, "key-input").send_keys("wrong key")
    by_id(driver, "key-save").click()
    time.sleep(0.5)  # the retry with the wrong key answers 401 again, and the dialog comes back
    wait_for(driver, lambda d: dialog.is_displayed(), "a wrong key was not asked for again")
    key_input = by_id(driver, "key-input")
    key_input.clear()
    key_input.send_keys(KEY)
    by_id(driver, "key-save").click()
    wait_for(driver, lambda d: by_id(d, "model").get_attribute("value") == MODEL, "no model listed")
    assert not dialog.is_displayed()
    assert by_id(driver, "api-key").get_attribute("value") == KEY  # the settings' field holds it now


def test_a_reply_streams_in_and_a_second_turn_follows(server, driver):
    open_page(driver, server.url)
    set_field(driver, "max-tokens", "24")
    lengths = []

    def grew(d) -> bool:  # the reply, sampled while it streams: it grows through several lengths
        reply = last_reply(d)
        lengths.append(len(reply["content"]))
        return reply["count"] == 1 and reply["state"] != "streaming"

    with slow_link(driver):
        send(driver, "Hello there")
        wait_for(driver, grew, "the first reply never ended")
    first = last_reply(driver)
    assert first["state"] == "done", first["text"]
    assert len(set(lengths)) > 2, f"no tokens streamed in: lengths {lengths}"
    send(driver, "And again")
    second = wait_done(driver, 2)
    assert second["state"] == "done", second["text"]
    assert second["content"]
    stored = driver.execute_script("return JSON.parse(localStorage.getItem('pagellm.chat.conversations'))")
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert stored[0]["title"] == "Hello there"

    by_id(driver, "regenerate").click()  # the last answer, again: still two answers
    regenerated = wait_done(driver, 2)
    assert regenerated["state"] == "done", regenerated["text"]

    open_page(driver, server.url, fresh=False)  # a reload keeps the conversation
    assert last_reply(driver)["count"] == 2
    by_id(driver, "new-chat").click()
    assert last_reply(driver)["count"] == 0
    conversations = driver.find_elements("css selector", "#conversations li")
    assert len(conversations) == 2
    conversations[1].find_element("css selector", ".open").click()
    assert last_reply(driver)["count"] == 2
    driver.find_element("css selector", "#conversations li.active .delete").click()  # the one shown
    left = driver.find_elements("css selector", "#conversations li")
    assert [li.text.splitlines()[0] for li in left] == ["New chat"]
    assert last_reply(driver)["count"] == 0


# keeps the body of each chat completion the page sends, in window.sentBodies
RECORD_REQUESTS = """
window.sentBodies = [];
const fetched = window.fetch;
window.fetch = (path, options) => {
  if (path === '/v1/chat/completions') window.sentBodies.push(JSON.parse(options.body));
  return fetched(path, options);
};
"""


def test_an_image_turn_on_a_vision_model(server, driver, tmp_path):
    open_page(driver, server.url)
    set_field(driver, "max-tokens", "12")
    picture = tmp_path / "picture.png"
    images(1, seed=5)[0].save(picture)
    by_id(driver, "attach").send_keys(str(picture))
    wait_for(driver, lambda d: by_id(d, "attachment").is_displayed(), "no preview of the attachment")
    driver.execute_script(RECORD_REQUESTS)
    send(driver, "What is in the image?")
    reply = wait_done(driver, 1)
    (request,) = driver.execute_script("return window.sentBodies")
    asked = request["messages"][-1]["content"]
    assert [part["type"] for part in asked] == ["text", "image_url"]
    assert asked[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert request["stream"] is True and request["model"] == MODEL and request["max_tokens"] == 12
    assert reply["state"] == "done", reply["text"]
    shown = driver.find_element("css selector", ".message.user img.image")
    assert shown.get_attribute("src").startswith("data:image/png;base64,")
    assert not by_id(driver, "attachment").is_displayed()  # sent, and cleared from the composer
    if os.environ.get("PAGELLM_UPDATE_SCREENSHOT") == "1":
        send(driver, "Thanks! Describe it once more.")
        wait_done(driver, 2)
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOT))


def test_stop_ends_a_stream_mid_way(server, driver):
    open_page(driver, server.url)
    set_field(driver, "max-tokens", "400")
    set_field(driver, "temperature", "0")  # greedy: the tiny model runs on to max_tokens
    with slow_link(driver):  # the stream is still going when Stop is clicked
        send(driver, "Tell me a long story")
        wait_for(driver, lambda d: by_id(d, "stop").is_displayed(), "no stop button while streaming")
        wait_for(
            driver,
            lambda d: last_reply(d)["content"],
            "no token streamed in",
        )
        by_id(driver, "stop").click()
        reply = wait_done(driver, 1)
    assert reply["state"] == "stopped", reply["text"]
    assert "Stopped." in reply["text"]
    assert by_id(driver, "send").is_displayed() and not by_id(driver, "stop").is_displayed()
    time.sleep(1)
    assert last_reply(driver)["content"] == reply["content"]  # nothing more came in
    set_field(driver, "max-tokens", "8")
    send(driver, "Short one")  # the page and the server go on after a stop
    after = wait_done(driver, 2)
    assert after["state"] == "done", after["text"]


# a stream as a reasoning model with tools sends it, cut into pieces mid-event (one with CRLF line ends), fed
# through the page's own SSE reader and chunk handler, then rendered
FAKE_STREAM = r"""
const done = arguments[arguments.length - 1];
const chunks = [
  {choices: [{index: 0, delta: {role: 'assistant'}}]},
  {choices: [{index: 0, delta: {reasoning_content: 'The user wants '}}]},
  {choices: [{index: 0, delta: {reasoning_content: 'the weather.'}}]},
  {choices: [{index: 0, delta: {tool_calls: [{index: 0, id: 'call_1', type: 'function',
                                              function: {name: 'get_weather', arguments: '{"city": '}}]}}]},
  {choices: [{index: 0, delta: {tool_calls: [{index: 0, function: {arguments: '"Paris"}'}}]}}]},
  {choices: [{index: 0, delta: {content: 'Checking '}}]},
  {choices: [{index: 0, delta: {content: 'now.'}, finish_reason: 'tool_calls'}]},
];
let text = chunks.map((c, i) => 'data: ' + JSON.stringify(c) + (i === 2 ? '\r\n\r\n' : '\n\n')).join('');
text += 'data: [DONE]\n\n';
const bytes = new TextEncoder().encode(text);
const stream = new ReadableStream({start(controller) {
  for (let i = 0; i < bytes.length; i += 37) controller.enqueue(bytes.slice(i, i + 37));
  controller.close();
}});
const message = {role: 'assistant', content: '', state: 'done', model: 'm'};
readEvents(new Response(stream), (data) => applyChunk(message, JSON.parse(data))).then(() => {
  const node = renderMessage(message);
  document.body.append(node);
  done({message: message, reasoning: node.querySelector('.reasoning-text').textContent,
        tool: node.querySelector('.tool-name').textContent, args: node.querySelector('.tool-args').textContent,
        answer: node.querySelector('.content').textContent});
}, (e) => done({error: String(e)}));
"""


def test_reasoning_and_tool_calls_show_apart_from_the_answer(server, driver):
    open_page(driver, server.url)
    shown = driver.execute_async_script(FAKE_STREAM)
    assert "error" not in shown, shown
    assert shown["reasoning"] == "The user wants the weather."
    assert shown["tool"] == "Tool call: get_weather"
    assert shown["args"] == '{"city": "Paris"}'
    assert shown["answer"] == "Checking now."  # the answer alone: no reasoning, no tool call in it
    assert shown["message"]["finish"] == "tool_calls"


SHRINK = """
const done = arguments[arguments.length - 1];
const canvas = document.createElement('canvas');
canvas.width = 3000;
canvas.height = 1500;
canvas.getContext('2d').fillRect(0, 0, 10, 10);
const big = canvas.toDataURL('image/png');
Promise.all([shrink(big, 5e6), shrink(big.slice(0, 40), 100)]).then(([url, bad]) => {
  const img = new Image();
  img.onload = () => done({type: url.slice(0, 15), width: img.naturalWidth, height: img.naturalHeight,
                           badKept: bad === big.slice(0, 40)});
  img.src = url;
});
"""


def test_a_large_image_is_shrunk_before_it_is_sent(server, driver):
    """A camera photo would pass the server's body limit; the page redraws it at most 1536 pixels a side."""
    open_page(driver, server.url)
    shrunk = driver.execute_async_script(SHRINK)
    assert shrunk == {"type": "data:image/jpeg", "width": 1536, "height": 768, "badKept": True}

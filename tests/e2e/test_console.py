"""End-to-end: the console (`/admin/ui/`) clicked through in a real browser.

Debian's `chromium`, driven by Selenium through Debian's `chromium-driver` (both installed by
scripts/test.sh when missing; nothing is downloaded by Selenium), headless, with a fresh
profile. Memproxy runs in front of the mock upstream (`examples/mock_upstream.rs`), once with
memory in sled and once in a redis-server started here on a free loopback port; its store is
populated through real chat requests (a user with `X-Memory-User-Id`, so that the mock's
scripted extraction gives them memories; enough turns for a summary; an older fact that is
recalled). Then each page is checked against the admin API and the mock's own record of what
it received:

- without the token no page shows data and every data request is 401;
- the conversation list shows the stored conversations, and one conversation its turns, its
  summary and its latest receipts;
- the receipt view shows the prompt's parts, and each message shown is, byte for byte after
  parsing, the message at the position it names in the forwarded body (which is the body the
  mock received);
- a memory corrected in the page is the memory forwarded with the next request;
- a delete confirmed in the page leaves the admin API answering 404;
- the cost page draws one point per stored exchange.

Screenshots of every page go to target/console-screenshots/ (not committed); the receipt
view's is copied to docs/console-receipt.png by `MEMPROXY_CONSOLE_SCREENSHOT=1`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

from test_openai_sdk import (
    API_KEY,
    MEMPROXY_BIN,
    MOCK_BIN,
    MODEL,
    REPO_ROOT,
    TARGET_DIR,
    _assert_no_refusals,
    _start_memproxy,
    _start_mock,
    _stop,
)
from test_redis_replicas import _start_redis

ADMIN_TOKEN = "admin-token-console-e2e"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = TARGET_DIR / "console-screenshots"
WAIT = 20.0

# Small settings so a handful of turns makes a summary, an extraction and a recall.
CONFIG = """
[memory]
recent_n = 4
window_step = 0
compression_threshold_tokens = 120
compression_interval = "PT0S"
compression_async = false
extraction_every = 2
relevance_top_k = 3
"""

EXTRACTED = {
    "memories": [
        {"text": "The user lives in Lisbon", "type": "profile", "scope": "private",
         "importance": 0.9, "confidence": 0.95, "tags": ["home"], "source_turns": [1],
         "supersedes": []},
        {"text": "The user prefers short answers", "type": "preference", "scope": "private",
         "importance": 0.5, "confidence": 0.8, "tags": [], "source_turns": [3], "supersedes": []},
    ]
}


@dataclass
class Env:
    backend: str
    port: int
    mock_url: str
    tenant: str
    conversation: str
    user: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def _http(url: str, method: str = "GET", body: object | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={
        "content-type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _admin(env: Env, method: str, path: str, body: object | None = None) -> tuple[int, object]:
    status, _, raw = _http(env.url("/admin/v1" + path), method, body,
                           {"authorization": f"Bearer {ADMIN_TOKEN}"})
    return status, json.loads(raw) if raw else None


def _chat(port: int, conversation: str, messages: list[dict[str, object]],
          user: str | None = None, agent: str | None = None,
          extra: dict[str, str] | None = None) -> tuple[dict[str, str], dict]:
    headers = {"authorization": f"Bearer {API_KEY}", "x-memory-conversation-id": conversation,
               **(extra or {})}
    if user:
        headers["x-memory-user-id"] = user
    if agent:
        headers["x-memory-agent"] = agent
    status, answer_headers, raw = _http(f"http://127.0.0.1:{port}/v1/chat/completions", "POST",
                                        {"model": MODEL, "messages": messages}, headers)
    assert status == 200, raw
    return {k.lower(): v for k, v in answer_headers.items()}, json.loads(raw)


def _converse(port: int, conversation: str, texts: list[str], user: str | None = None,
              agent: str | None = None) -> list[dict[str, object]]:
    """Sends each text as the next user turn with the whole history (the SDK's habit);
    returns the history."""
    history: list[dict[str, object]] = [{"role": "system", "content": "You are a travel helper."}]
    for text in texts:
        history.append({"role": "user", "content": text})
        _, answer = _chat(port, conversation, history, user, agent)
        history.append(answer["choices"][0]["message"])
    return history


def _eventually(what: str, check, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except StaleElementReferenceException:
            # The page re-rendered between finding an element and reading it: look again.
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module", params=["sled", "redis"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    for binary in (MOCK_BIN, MEMPROXY_BIN):
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run `cargo build --bins --examples` first")
    backend = request.param
    workdir = tmp_path_factory.mktemp(f"memproxy-console-{backend}")
    started = []
    try:
        extra: tuple[str, ...] = ()
        if backend == "redis":
            redis, redis_port = _start_redis(workdir)
            started.append(redis)
            extra = ("--redis-url", f"redis://127.0.0.1:{redis_port}")
        mock, mock_url = _start_mock(workdir)
        started.append(mock)
        proxy, port = _start_memproxy(workdir, mock_url, CONFIG, extra_args=extra,
                                      extra_env={"MEMPROXY_ADMIN_TOKEN": ADMIN_TOKEN})
        started.append(proxy)
        run = uuid.uuid4().hex[:8]
        env = Env(backend, port, mock_url, "", f"trip-{run}", f"ana-{run}")
        _populate(env)
        yield env
        _assert_no_refusals(mock_url)
    finally:
        for proc in reversed(started):
            _stop(proc)


def _populate(env: Env) -> None:
    status, _, _ = _http(env.mock_url.removesuffix("/v1") + "/_mock/script", "POST",
                         {"extraction": EXTRACTED})
    assert status == 200
    _converse(env.port, env.conversation, [
        "I live in Lisbon and my sailing boat Seagull is moored in Cascais marina.",
        "I prefer short answers, please.",
        "Plan a day trip to Sintra for next Saturday with a picnic in the gardens.",
        "Which train goes from Rossio to Sintra and how long does it take?",
        "Add a visit to the Pena palace in the afternoon before the last train.",
        "Could we also see the Moorish castle walls if the weather is clear?",
        "Where is my sailing boat Seagull moored, and can we sail there on Sunday?",
    ], user=env.user)
    _converse(env.port, f"other-{env.conversation}", ["Hello there, how are you today?"],
              agent="support")
    _converse(env.port, f"to-delete-{env.conversation}", ["Please forget me after this."])
    # A Responses API exchange: its receipt's body is in that API's own form.
    status, _, raw = _http(env.url("/v1/responses"), "POST", {"model": MODEL, "input": "Hello from the Responses API"},
                           {"authorization": f"Bearer {API_KEY}", "x-memory-conversation-id": f"responses-{env.conversation}"})
    assert status == 200, raw
    # Another user, whom the memories test deletes from the page.
    _converse(env.port, f"bob-{env.conversation}", ["Book me a table for two tonight."], user=f"bob-{env.user}")
    # A closed branch: the second question edited after two more turns were stored.
    history = _converse(env.port, f"branchy-{env.conversation}", [
        "Which tram goes up to the castle?", "Is the 28 tram crowded in the morning?",
        "What does a day ticket cost?"])
    _chat(env.port, f"branchy-{env.conversation}",
          history[:3] + [{"role": "user", "content": "Is the 12 tram quieter than the 28?"}])
    # A budget that drops turns: the last request of a longer conversation under 90 tokens.
    history = _converse(env.port, f"budget-{env.conversation}", [
        f"Tell me about viewpoint number {i} over the river and its opening hours" for i in range(1, 6)])
    _chat(env.port, f"budget-{env.conversation}",
          history + [{"role": "user", "content": "Which viewpoint is the best at sunset?"}],
          extra={"x-memory-max-context-tokens": "90"})
    status, tenants = _admin(env, "GET", "/tenants")
    assert status == 200 and len(tenants["tenants"]) == 1, tenants
    env.tenant = tenants["tenants"][0]["tenant"]
    path = f"/conversations/{env.tenant}/default/{env.conversation}/stats"
    stats = _eventually("a summary", lambda: (s := _admin(env, "GET", path)[1]) and s["summaries"] and s)
    assert stats["summaries"] >= 1
    _eventually("the extracted memories", lambda: _admin(
        env, "GET", f"/users/{env.tenant}/{env.user}/memories")[0] == 200)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.fail("chromium and chromium-driver are missing: scripts/test.sh installs them")
    # Selenium must find nothing to download: the browser and its driver are given.
    os.environ["SE_OFFLINE"] = "true"
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1000",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {
        "download.default_directory": str(downloads), "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def _ready(driver: webdriver.Chrome, page: str):
    """Waits for the page `page` to have rendered (or failed), and returns its view."""
    def rendered(d):
        views = d.find_elements(By.CSS_SELECTOR, f"#view[data-page='{page}'][data-ready]")
        return views[0] if views else False
    try:
        view = WebDriverWait(driver, WAIT).until(rendered)
    except TimeoutException:
        raise AssertionError(f"page {page} did not render: {driver.page_source[:2000]}") from None
    errors = view.find_elements(By.CSS_SELECTOR, "[data-error]")
    assert view.get_attribute("data-ready") == "true", [e.text for e in errors]
    lines = view.text.splitlines()
    for blank in ("null", "undefined", "NaN", "[object Object]"):
        assert not any(blank in line.split() for line in lines), (page, blank, [l for l in lines if blank in l.split()])
    return view


def _click_to(driver: webdriver.Chrome, element, page: str):
    """Clicks what renders another view, and waits for it (page `page`)."""
    old = driver.find_element(By.ID, "view")
    element.click()
    WebDriverWait(driver, WAIT).until(expected_conditions.staleness_of(old))
    return _ready(driver, page)


def _go(driver: webdriver.Chrome, env: Env, hash_: str, page: str):
    driver.get(env.url("/admin/ui/#/" + hash_))
    return _ready(driver, page)


def _shot(driver: webdriver.Chrome, env: Env, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{env.backend}-{name}.png"
    # The whole page: the window as tall as the document.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, min(max(int(height), 600), 6000))
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 1000)
    return path


def _type_token(driver: webdriver.Chrome, env: Env, token: str) -> None:
    driver.get(env.url("/admin/ui/"))
    field = WebDriverWait(driver, WAIT).until(lambda d: d.find_element(By.ID, "token-input"))
    field.send_keys(token)
    driver.find_element(By.ID, "token-submit").click()


def _log_in(driver: webdriver.Chrome, env: Env):
    """Types the admin token into the page, and returns the list it then shows."""
    _type_token(driver, env, ADMIN_TOKEN)
    return _ready(driver, "conversations")


def _fetch_status(driver: webdriver.Chrome, path: str, token: str | None) -> int:
    return driver.execute_async_script(
        """const [path, token, done] = arguments;
        const headers = token ? {Authorization: 'Bearer ' + token} : {};
        fetch(path, {headers}).then((r) => done(r.status), () => done(-1));""",
        path, token)


def test_without_the_token_no_page_shows_data_and_every_request_is_refused(env: Env, browser) -> None:
    for hash_ in ("conversations", f"conversation/{env.tenant}/default/{env.conversation}",
                  "memories", "cost", "receipt/rcpt_x"):
        browser.get(env.url("/admin/ui/#/" + hash_))
        login = WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "login"))
        WebDriverWait(browser, WAIT).until(lambda d: login.is_displayed())
        assert browser.find_element(By.ID, "main").text == ""
        assert env.conversation not in browser.page_source
    for path in ("/admin/v1/status", "/admin/v1/conversations", "/admin/v1/tenants",
                 f"/admin/v1/users/{env.tenant}/{env.user}/memories"):
        assert _fetch_status(browser, path, None) == 401, path
        assert _fetch_status(browser, path, "wrong-token") == 401, path
    assert browser.get_cookies() == []
    _shot(browser, env, "login")

    # A wrong token typed in is refused, forgotten, and nothing is shown.
    _type_token(browser, env, "wrong-token")
    error = WebDriverWait(browser, WAIT).until(
        lambda d: (e := d.find_element(By.ID, "login-error")).text and e)
    assert "401" in error.text
    assert env.conversation not in browser.page_source
    assert browser.execute_script("return sessionStorage.length") == 0


def test_the_list_and_a_conversation_show_what_is_stored(env: Env, browser) -> None:
    view = _log_in(browser, env)
    status, listing = _admin(env, "GET", "/conversations")
    assert status == 200
    rows = view.find_elements(By.CSS_SELECTOR, "#conversations tbody tr[data-conversation]")
    assert sorted(r.get_attribute("data-conversation") for r in rows) == sorted(
        c["id"] for c in listing["conversations"])
    badge = browser.find_element(By.ID, "store-badge").text
    assert env.backend in badge
    assert not browser.find_element(By.ID, "banner").is_displayed()
    _shot(browser, env, "conversations")

    # Paging, five at a time: every conversation once, in the API's order, and back again.
    Select(view.find_element(By.ID, "limit")).select_by_value("5")
    view = _click_to(browser, view.find_element(By.ID, "search"), "conversations")
    def rows() -> list[str]:
        return [r.get_attribute("data-conversation") for r in browser.find_elements(
            By.CSS_SELECTOR, "#conversations tbody tr[data-conversation]")]

    pages: list[list[str]] = [rows()]
    while following := view.find_elements(By.ID, "next-page"):
        view = _click_to(browser, following[0], "conversations")
        pages.append(rows())
    assert len(pages) == -(-len(listing["conversations"]) // 5) >= 2
    assert [c for page in pages for c in page] == [c["id"] for c in listing["conversations"]]
    view = _click_to(browser, view.find_element(By.ID, "previous-page"), "conversations")
    assert rows() == pages[-2]
    view = _go(browser, env, "conversations", "conversations")

    # The search by id.
    field = view.find_element(By.ID, "q")
    field.send_keys("other-")
    view = _click_to(browser, view.find_element(By.ID, "search"), "conversations")
    _eventually("the search", lambda: [r.get_attribute("data-conversation") for r in browser.find_elements(
        By.CSS_SELECTOR, "#conversations tbody tr[data-conversation]")] == [f"other-{env.conversation}"])

    # One conversation: every stored turn, the summary with the turns it covers, the receipts.
    view = _go(browser, env, "conversations", "conversations")
    link = view.find_element(By.CSS_SELECTOR, f"tr[data-conversation='{env.conversation}'] a")
    view = _click_to(browser, link, "conversation")
    _, shown = _admin(env, "GET", f"/conversations/{env.tenant}/default/{env.conversation}")
    turns = [int(t.get_attribute("data-turn")) for t in view.find_elements(By.CSS_SELECTOR, "#timeline [data-turn]")]
    assert turns == [m["turn"] for m in shown["messages"]]
    summaries = view.find_elements(By.CSS_SELECTOR, "#timeline [data-summary]")
    assert len(summaries) == len(shown["summaries"]) >= 1
    record = shown["summaries"][0]["record"]
    assert f"covers turns {record['from_turn']}–{record['to_turn']}" in summaries[0].text
    receipts = view.find_elements(By.CSS_SELECTOR, "#receipts tr[data-receipt]")
    _, listed = _admin(env, "GET", f"/conversations/{env.tenant}/default/{env.conversation}/receipts?limit=10")
    assert [r.get_attribute("data-receipt") for r in receipts] == [r["id"] for r in listed["receipts"]]
    assert len(receipts) == 7
    _shot(browser, env, "conversation")

    # A conversation with a closed branch shows it apart, with the messages that left the line.
    branchy = f"branchy-{env.conversation}"
    view = _go(browser, env, f"conversation/{env.tenant}/default/{branchy}", "conversation")
    _, shown = _admin(env, "GET", f"/conversations/{env.tenant}/default/{branchy}")
    assert len(shown["branches"]) == 1
    branch = view.find_element(By.CSS_SELECTOR, "[data-branch]")
    branch.find_element(By.TAG_NAME, "summary").click()
    assert f"forked after turn {shown['branches'][0]['forked_after_turn']}" in branch.text
    assert [int(t.get_attribute("data-turn")) for t in branch.find_elements(By.CSS_SELECTOR, "[data-turn]")] == [
        m["turn"] for m in shown["branches"][0]["messages"]]
    assert "Is the 28 tram crowded in the morning?" in branch.text
    timeline_text = view.find_element(By.ID, "timeline").text
    assert "Is the 12 tram quieter" in timeline_text and "28 tram crowded" not in timeline_text
    _shot(browser, env, "conversation-branch")


def test_a_receipt_shows_the_parts_of_the_body_forwarded(env: Env, browser) -> None:
    _log_in(browser, env)
    view = _go(browser, env, f"conversation/{env.tenant}/default/{env.conversation}", "conversation")
    # The newest receipt: the question that recalls the boat from the first turn.
    view = _click_to(browser, view.find_element(By.CSS_SELECTOR, "#receipts tr[data-receipt] a.receipt-link"), "receipt")
    receipt_id = view.find_element(By.ID, "receipt-id").text
    status, receipt = _admin(env, "GET", f"/receipts/{receipt_id}")
    assert status == 200
    body = receipt["forwarded"]["body"].encode()
    assert view.find_element(By.ID, "body-sha").text == hashlib.sha256(body).hexdigest()
    # The body the mock received is the receipt's body.
    _, _, raw = _http(env.mock_url.removesuffix("/v1") + "/_mock/requests")
    received = [r["body"] for r in json.loads(raw)
                if r["path"].endswith("/chat/completions") and not r["headers"].get("x-memproxy-task")]
    forwarded = json.loads(body)
    assert forwarded in received
    messages = forwarded["messages"]

    # Each part shown, with its messages; each message the body's message at the place it names.
    shown_parts = [p.get_attribute("data-part") for p in view.find_elements(By.CSS_SELECTOR, "#parts [data-part]")]
    expected_parts = [p for p in ("instructions", "summary", "memories", "window", "recalled", "new")
                      if receipt["prompt"][p] and receipt["prompt"][p]["messages"]]
    assert shown_parts == expected_parts
    for needed in ("summary", "memories", "recalled", "window", "new"):
        assert needed in shown_parts, f"the populated store gives a {needed} part"
    covered = []
    for part in view.find_elements(By.CSS_SELECTOR, "#parts [data-part]"):
        name = part.get_attribute("data-part")
        tokens = int(part.find_element(By.CSS_SELECTOR, "[data-part-tokens]").get_attribute("data-part-tokens"))
        assert tokens == receipt["prompt"][name]["tokens"]
        for message in part.find_elements(By.CSS_SELECTOR, "[data-message]"):
            at = int(message.find_element(By.CSS_SELECTOR, "[data-body-index]").get_attribute("data-body-index"))
            raw_json = message.find_element(By.CSS_SELECTOR, "[data-raw]").get_attribute("textContent")
            assert at >= 0, f"a {name} message is not in the body: {raw_json}"
            assert json.loads(raw_json) == messages[at]
            covered.append(at)
    assert sorted(covered) == list(range(len(messages))), "every forwarded message is in a part"
    recalled_rows = view.find_elements(By.CSS_SELECTOR, "[data-part='recalled'] tr[data-recalled-turn]")
    assert [int(r.get_attribute("data-recalled-turn")) for r in recalled_rows] == [
        t["turn"] for t in receipt["prompt"]["recalled"]["turns"]]
    assert "Seagull" in view.find_element(By.CSS_SELECTOR, "[data-part='recalled']").text
    assert view.find_element(By.ID, "settings").find_elements(By.CSS_SELECTOR, "tbody tr")
    assert view.find_element(By.ID, "budget").text
    path = _shot(browser, env, "receipt")
    if env.backend == "sled" and os.environ.get("MEMPROXY_CONSOLE_SCREENSHOT") == "1":
        browser.set_window_size(1100, 900)
        browser.save_screenshot(str(REPO_ROOT / "docs" / "console-receipt.png"))
    assert path.exists()

    # What the budget dropped, turn by turn, on a request with a small max_context_tokens.
    budgeted = f"budget-{env.conversation}"
    _, listed = _admin(env, "GET", f"/conversations/{env.tenant}/default/{budgeted}/receipts?limit=1")
    trimmed_id = listed["receipts"][0]["id"]
    _, trimmed = _admin(env, "GET", f"/receipts/{trimmed_id}")
    assert trimmed["budget"]["verdict"] == "trimmed" and trimmed["budget"]["dropped"]["window_turns"]
    view = _go(browser, env, f"receipt/{trimmed_id}?tenant={env.tenant}", "receipt")
    card = view.find_element(By.ID, "budget")
    assert card.get_attribute("data-verdict") == "trimmed"
    assert [int(t.get_attribute("data-dropped-window")) for t in card.find_elements(
        By.CSS_SELECTOR, "[data-dropped-window]")] == trimmed["budget"]["dropped"]["window_turns"]
    assert [int(t.get_attribute("data-dropped-recalled")) for t in card.find_elements(
        By.CSS_SELECTOR, "[data-dropped-recalled]")] == [d["turn"] for d in trimmed["budget"]["dropped"]["recalled"]]
    _shot(browser, env, "receipt-budget")

    # A Responses API receipt: its parts, and the body in that API's form.
    _, listed = _admin(env, "GET", f"/conversations/{env.tenant}/default/responses-{env.conversation}/receipts")
    view = _go(browser, env, f"receipt/{listed['receipts'][0]['id']}", "receipt")
    assert "responses" in view.text and "in its own form" in view.text
    assert "Hello from the Responses API" in view.find_element(By.CSS_SELECTOR, "[data-part='new']").text
    view = _go(browser, env, f"receipt/{receipt_id}?tenant={env.tenant}", "receipt")

    # The replay button: the same bytes go upstream again, nothing is stored.
    before = len(json.loads(_http(env.mock_url.removesuffix("/v1") + "/_mock/requests")[2]))
    # Memproxy holds no upstream key here: the replay needs the client's credential.
    browser.find_element(By.ID, "replay").click()
    refused = WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "replay-answer"))
    assert "400" in browser.find_element(By.ID, "replay-result").text and "credential" in refused.text
    browser.find_element(By.CSS_SELECTOR, "#replay-form input[name='credential']").send_keys(f"Bearer {API_KEY}")
    browser.find_element(By.ID, "replay").click()
    answer = WebDriverWait(browser, WAIT).until(
        lambda d: (a := d.find_element(By.ID, "replay-answer")) and "reply to:" in a.text and a)
    assert "200" in browser.find_element(By.ID, "replay-result").text
    after = json.loads(_http(env.mock_url.removesuffix("/v1") + "/_mock/requests")[2])
    assert len(after) == before + 1 and after[-1]["body"] == forwarded


def test_a_memory_corrected_in_the_page_is_the_one_forwarded_next(env: Env, browser) -> None:
    _log_in(browser, env)
    view = _go(browser, env, f"memories?tenant={env.tenant}&user={env.user}", "memories")
    _, listed = _admin(env, "GET", f"/users/{env.tenant}/{env.user}/memories")
    cards = view.find_elements(By.CSS_SELECTOR, "#memories [data-memory-id]")
    assert sorted(int(c.get_attribute("data-memory-id")) for c in cards) == sorted(m["id"] for m in listed["memories"])
    lisbon = next(m for m in listed["memories"] if "Lisbon" in m["text"])
    card = view.find_element(By.CSS_SELECTOR, f"[data-memory-id='{lisbon['id']}']")
    assert "profile" in card.text and "private" in card.text and "decay" in card.text
    _shot(browser, env, "memories")

    card.find_element(By.CSS_SELECTOR, "button.edit-memory").click()
    text = card.find_element(By.CSS_SELECTOR, "textarea[name='text']")
    text.clear()
    text.send_keys("The user lives in Porto")
    card.find_element(By.CSS_SELECTOR, "button.save-memory").click()
    WebDriverWait(browser, WAIT).until(lambda d: "Porto" in d.find_element(
        By.CSS_SELECTOR, f"[data-memory-id='{lisbon['id']}'] .memory-text").text)
    history = browser.find_element(By.CSS_SELECTOR, f"[data-memory-id='{lisbon['id']}'] details.history")
    history.click()
    assert "The user lives in Lisbon" in history.text
    _, corrected = _admin(env, "GET", f"/users/{env.tenant}/{env.user}/memories/{lisbon['id']}")
    assert corrected["text"] == "The user lives in Porto" and corrected["version"] == 2

    # The next request of the user (a new conversation) carries the corrected memory upstream.
    headers, _ = _chat(env.port, f"next-{env.conversation}",
                       [{"role": "user", "content": "Where do I live these days?"}], env.user)
    _, _, raw = _http(env.mock_url.removesuffix("/v1") + "/_mock/requests")
    last = [r for r in json.loads(raw) if r["path"].endswith("/chat/completions")
            and not r["headers"].get("x-memproxy-task")][-1]
    sent = json.dumps(last["body"])
    assert "The user lives in Porto" in sent and "The user lives in Lisbon" not in sent
    _, receipt = _admin(env, "GET", f"/receipts/{headers['x-memory-receipt']}")
    assert lisbon["id"] in [m["id"] for m in receipt["prompt"]["memories"]["items"]]

    # The search ranks the user's memories as a prompt would, with their scores.
    view = _go(browser, env, f"memories?tenant={env.tenant}&user={env.user}", "memories")
    view.find_element(By.ID, "memory-q").send_keys("where does the user live, Porto?")
    view.find_element(By.ID, "memory-show").click()
    found = _eventually("the search's results", lambda: browser.find_elements(
        By.CSS_SELECTOR, "#view[data-ready='true'] #memories [data-memory-id]") if "Found for" in browser.find_element(
        By.ID, "main").text else None)
    assert found[0].get_attribute("data-memory-id") == str(lisbon["id"])
    assert "score" in found[0].text

    # A memory added in the page, then deleted in the page after its confirmation.
    view = _go(browser, env, f"memories?tenant={env.tenant}&user={env.user}", "memories")
    form = view.find_elements(By.CSS_SELECTOR, "form.memory-form")[-1]
    form.find_element(By.CSS_SELECTOR, "textarea[name='text']").send_keys("The user is allergic to peanuts")
    Select(form.find_element(By.NAME, "type")).select_by_value("semantic")
    form.find_element(By.CSS_SELECTOR, "button.save-memory").click()
    # The page renders again with the new memory in its list.
    peanuts = _eventually("the new memory", lambda: next(
        (c for c in browser.find_elements(By.CSS_SELECTOR, "#memories [data-memory-id]") if "peanuts" in c.text), None))
    memory_id = peanuts.get_attribute("data-memory-id")
    assert _admin(env, "GET", f"/users/{env.tenant}/{env.user}/memories/{memory_id}")[0] == 200
    peanuts.find_element(By.CSS_SELECTOR, "button.delete-memory").click()
    browser.find_element(By.ID, "confirm-ok").click()
    _eventually("the memory deleted", lambda: _admin(
        env, "GET", f"/users/{env.tenant}/{env.user}/memories/{memory_id}")[0] == 404)

    # The user's delete, confirmed by typing the user id: their conversations go too.
    bob = f"bob-{env.user}"
    assert _admin(env, "GET", f"/conversations/{env.tenant}/default/bob-{env.conversation}")[0] == 200
    view = _go(browser, env, f"memories?tenant={env.tenant}&user={bob}", "memories")
    view.find_element(By.ID, "delete-user").click()
    browser.find_element(By.ID, "confirm-typed").send_keys(bob)
    browser.find_element(By.ID, "confirm-ok").click()
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "user-deleted"))
    assert _admin(env, "GET", f"/conversations/{env.tenant}/default/bob-{env.conversation}")[0] == 404
    assert _admin(env, "GET", f"/users/{env.tenant}/{bob}/export")[0] == 404
    assert _admin(env, "GET", f"/users/{env.tenant}/{env.user}/memories")[0] == 200, "only that user"


def test_cost_pages_draw_the_ledger(env: Env, browser) -> None:
    _log_in(browser, env)
    view = _go(browser, env, f"cost/{env.tenant}/default/{env.conversation}", "cost")
    _, stats = _admin(env, "GET", f"/conversations/{env.tenant}/default/{env.conversation}/stats")
    points = view.find_elements(By.CSS_SELECTOR, "#exchange-chart circle[data-point]")
    assert [int(p.get_attribute("data-point")) for p in points] == [e["turn"] for e in stats["exchanges"]]
    assert len(points) == stats["ledger"]["exchanges"] == 7
    for series in ("history", "forwarded"):
        assert view.find_element(By.CSS_SELECTOR, f"#exchange-chart path[data-series='{series}']")
    saved = view.find_element(By.CSS_SELECTOR, "#ledger [data-figure='saved tokens'] .value").text
    assert saved.replace(",", "") == str(stats["ledger"]["saved_tokens"])
    _shot(browser, env, "cost-conversation")

    view = _go(browser, env, f"cost?tenant={env.tenant}", "cost")
    _, tenant = _admin(env, "GET", f"/tenants/{env.tenant}/stats")
    agents = [r.get_attribute("data-agent") for r in view.find_elements(By.CSS_SELECTOR, "#agents tr[data-agent]")]
    assert agents == sorted(tenant["agents"])
    forwarded = view.find_element(By.CSS_SELECTOR, "#ledger [data-figure='forwarded tokens'] .value").text
    assert forwarded.replace(",", "") == str(tenant["ledger"]["forwarded_tokens"])
    assert view.find_elements(By.CSS_SELECTOR, "#agent-chart rect")
    _shot(browser, env, "cost-tenant")


def test_export_delete_and_import_in_the_page(env: Env, browser) -> None:
    doomed = f"to-delete-{env.conversation}"
    path = f"/conversations/{env.tenant}/default/{doomed}"
    status, stored = _admin(env, "GET", path)
    assert status == 200
    _log_in(browser, env)
    view = _go(browser, env, f"conversation/{env.tenant}/default/{doomed}", "conversation")

    # Export: the file the browser saves is the admin API's export.
    view.find_element(By.ID, "export").click()
    saved = browser.downloads / f"{doomed}.memproxy.json"
    _eventually("the export's download", lambda: saved.exists() and saved.stat().st_size > 0)
    exported = json.loads(saved.read_text())
    assert exported == _admin(env, "GET", path + "/export")[1]
    assert len(exported["messages"]) == stored["message_count"]

    # Delete: nothing before the id is typed, nothing when cancelled.
    view.find_element(By.ID, "delete-conversation").click()
    dialog = browser.find_element(By.ID, "confirm")
    assert dialog.is_displayed()
    ok = browser.find_element(By.ID, "confirm-ok")
    assert not ok.is_enabled(), "the id must be typed first"
    browser.find_element(By.ID, "confirm-cancel").click()
    assert _admin(env, "GET", path)[0] == 200, "a cancelled delete deletes nothing"

    view.find_element(By.ID, "delete-conversation").click()
    browser.find_element(By.ID, "confirm-typed").send_keys(doomed)
    _shot(browser, env, "delete-confirmation")
    view = _click_to(browser, browser.find_element(By.ID, "confirm-ok"), "conversations")
    assert _admin(env, "GET", path)[0] == 404
    assert _admin(env, "GET", path + "/export")[0] == 404
    assert doomed not in [r.get_attribute("data-conversation") for r in browser.find_elements(
        By.CSS_SELECTOR, "#conversations tr[data-conversation]")]

    # Import the saved file from the list page: the conversation is back, whole.
    view.find_element(By.ID, "import-file").send_keys(str(saved))
    view.find_element(By.CSS_SELECTOR, "#import-form button[type='submit']").click()
    _eventually("the import", lambda: "Imported" in browser.find_element(By.ID, "import-status").text)
    _ready(browser, "conversation")
    status, back = _admin(env, "GET", path)
    assert status == 200
    assert [m["message"] for m in back["messages"]] == [m["message"] for m in stored["messages"]]


@pytest.mark.parametrize("backend", ["sled", "redis"])
def test_every_page_says_when_the_store_is_unavailable(backend: str, browser,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    workdir = tmp_path_factory.mktemp(f"memproxy-console-unavailable-{backend}")
    if backend == "redis":
        # A loopback port nothing listens on.
        from test_openai_sdk import _free_port
        extra: tuple[str, ...] = ("--redis-url", f"redis://127.0.0.1:{_free_port()}")
    else:
        # The data directory cannot be made: a file is in its place.
        (workdir / "data").write_text("not a directory")
        extra = ()
    proxy, port = _start_memproxy(workdir, "http://127.0.0.1:9/v1", extra_args=extra,
                                  extra_env={"MEMPROXY_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        env = Env(backend, port, "", "0" * 32, "c", "u")
        _type_token(browser, env, ADMIN_TOKEN)
        for hash_, page in (("conversations", "conversations"), ("memories?tenant=" + "0" * 32 + "&user=u", "memories"),
                            ("cost", "cost"), ("conversation/" + "0" * 32 + "/default/c", "conversation"),
                            ("receipt/rcpt_x", "receipt")):
            browser.get(env.url("/admin/ui/#/" + hash_))
            WebDriverWait(browser, WAIT * 2).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, f"#view[data-page='{page}'][data-ready]"))
            banner = browser.find_element(By.ID, "banner")
            assert banner.is_displayed(), hash_
            assert "store is unavailable" in banner.text, banner.text
            badge = browser.find_element(By.ID, "store-badge").text
            assert backend in badge and "unavailable" in badge
        _shot(browser, env, "store-unavailable")
    finally:
        _stop(proxy)


def test_console_files_carry_the_policy_and_no_cookie(env: Env) -> None:
    status, headers, raw = _http(env.url("/admin/ui/"))
    headers = {k.lower(): v for k, v in headers.items()}
    assert status == 200
    assert headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'")
    assert "set-cookie" not in headers
    assert b"<script>" not in raw

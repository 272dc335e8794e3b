"""The dashboard in a real headless Chromium against the real daemon and the real model, with and
without an API key: the exact latencies it shows equal the ones the streaming clients measured
themselves, the batch's rows appear, progress and go with the requests, a row's Cancel ends that
stream, the scheduler view moves while concurrent chats run, the chat playground streams and stops,
a pull from a local server shows its progress, and the console stays clean. The no-key run saves
the README's screenshot (docs/dashboard.png) while the load runs."""

from __future__ import annotations

import http.client
import io
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from localserve.api.live import percentile
from localserve.store.gguf_facts import read_gguf_facts

from browser_util import CHROMEDRIVER, CHROMIUM, MISSING, chromium, console_errors
from daemon_util import cli_env, free_port, register_model, serving, stop_quietly, wait_published
from test_gguf_facts import write_tiny_llama
from test_pull import LocalServer, Served

pytestmark = pytest.mark.model
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(MISSING, allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "docs" / "dashboard.png"
MODEL = "smollm2-135m"
API_KEY = "dashboard-test-key"
CHATS = 6  # two more than the daemon's 4 sequences (daemon_util.cli_env): the default lane queues
BATCH_LINES = 24  # a batch that takes several seconds: its progress is seen moving
LIVE_S = 60  # liveness bounds only: a 135M model answers in seconds even on a shared 2-core machine


def call(url: str, key: str | None, body: dict[str, Any] | None = None, timeout: float = 120,
         lane: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    headers |= {"X-Priority": lane} if lane else {}
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Iterator[LocalServer]:
    """A local file server with a GGUF big enough for several progress events (one a MiB), sent
    in 64 KiB chunks 20 ms apart: a few seconds of visible progress."""
    gguf = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()
    server = LocalServer().start()
    server.files["dash-pull.gguf"] = Served(gguf + bytes(4 << 20), delay=0.02)  # GGUF readers ignore the tail
    yield server
    server.stop()


@pytest.fixture(scope="module")
def no_eog(smollm2_gguf) -> dict[str, float]:
    """logit_bias banning the model's end-of-generation tokens: a stream runs to its max_tokens."""
    facts = read_gguf_facts(smollm2_gguf)
    return {str(t): -100 for t in {facts.eos_token_id, 0} if t is not None}


@pytest.fixture(scope="module", params=[None, API_KEY], ids=["no-key", "api-key"])
def daemon(request, smollm2_gguf, tmp_path_factory) -> Iterator[tuple[str, str | None]]:
    home = tmp_path_factory.mktemp("home")
    # The pull test downloads from the local file server, which the pull policy refuses by default.
    extra = {"LOCALSERVE_PULL_ALLOW_HTTP_HOSTS": "127.0.0.1"}
    if request.param:
        extra["LOCALSERVE_API_KEY"] = request.param
    env = cli_env(home, free_port(), **extra)
    register_model(env, smollm2_gguf)
    with serving(env) as proc:
        try:
            url = wait_published(home, proc)["url"]
            call(url + "/api/generate", request.param, {"model": MODEL})  # loaded before the page opens
            yield url, request.param
        finally:
            stop_quietly(env, proc)


@pytest.fixture(scope="module")
def page(daemon) -> Iterator[Any]:
    """The dashboard, open and live; with a key, after typing it into the page's own prompt."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    with chromium(window=(1100, 1280)) as driver:
        driver.get(url + "/")
        form = driver.find_element(By.ID, "key-form")
        assert form.is_displayed() is bool(key)
        if key:
            driver.find_element(By.ID, "key-input").send_keys(key)
            driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait = WebDriverWait(driver, LIVE_S, poll_frequency=0.1)
        wait.until(lambda d: d.find_element(By.ID, "conn").text == "live")
        if key:
            # Asked once: the tab keeps the key, a reload goes straight to live, and no URL holds it.
            assert driver.execute_script("return sessionStorage.getItem('localserve-api-key')") == key
            driver.refresh()
            wait.until(lambda d: d.find_element(By.ID, "conn").text == "live")
            assert not driver.find_element(By.ID, "key-form").is_displayed() and key not in driver.current_url
        yield driver
        # Every test's console is checked by `clean_console`; this catches what teardown's last reads caused.
        assert console_errors(driver) == []


@pytest.fixture
def clean_console(page) -> Iterator[None]:
    page.get_log("browser")  # what earlier tests left
    yield
    assert console_errors(page) == []


class TimedStream:
    """One streamed chat completion over a plain HTTP connection, timed by the client itself: when
    it sent the request and when each chunk with content arrived; and how the stream ended."""

    def __init__(self, url: str, key: str | None, body: dict[str, Any]):
        self.url, self.key, self.body = url, key, body
        self.sent = 0.0
        self.arrivals: list[float] = []
        self.frames: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "TimedStream":
        self.thread.start()
        return self

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=LIVE_S * 2)
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.key}"} if self.key else {})
        payload = json.dumps({**self.body, "stream": True}).encode()
        conn.connect()
        self.sent = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", payload, headers)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        while line := response.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            frame = json.loads(line[6:])
            self.frames.append(frame)
            if any((c.get("delta") or {}).get("content") for c in frame.get("choices", [])):
                self.arrivals.append(time.perf_counter())
        conn.close()

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


LATENCY = """
const m = window.__dashboard.last && window.__dashboard.last.models.find((m) => m.name.startsWith(arguments[0]));
if (!m) return null;
const out = {};
for (const e of document.querySelectorAll(`.card[data-model="${m.name}"] [data-lat]`)) out[e.dataset.lat] = e.textContent;
return out;"""

ROWS = """
return [...document.querySelectorAll(".seqs tbody tr")].map((r) => ({id: r.dataset.request, state: r.dataset.state,
  generated: Number(r.dataset.generated), text: r.textContent}));"""


def shown_ms(text: str) -> float:
    assert text.endswith(" ms"), text
    return float(text[:-3])


STREAMS = 4  # the daemon's max sequences: every stream decodes in the same batch


def test_exact_latencies_and_live_rows(page, daemon, no_eog, clean_console):
    """First on a fresh daemon, so the last minute holds these streams' samples only (the sample
    counts shown prove it). TTFT and ITL shown equal the clients' own timings' percentiles: the
    server times from the request's arrival and between the events it writes, the client from its
    send and between the chunks it reads; what separates them is loopback transport and the
    display's rounding to 1 ms."""
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    page.get(url + "/#scheduler")
    wait = WebDriverWait(page, LIVE_S, poll_frequency=0.1)
    wait.until(lambda d: d.execute_script(LATENCY, MODEL))
    # Each stream runs to its 96 tokens (no end-of-generation token), several seconds on any machine
    # here: a stream that stopped early could end between two 1-second snapshots, and the rows'
    # progress below would never be seen (a CI run at 48 tokens with EOS allowed saw exactly that).
    streams = [TimedStream(url, key, {"model": MODEL, "max_tokens": 96, "temperature": 0.8, "seed": i,
                                      "logit_bias": no_eog,
                                      "messages": [{"role": "user", "content": f"Tell story number {i}"}]}).start()
               for i in range(STREAMS)]
    rows = lambda d: d.execute_script(ROWS)  # noqa: E731
    # The rows appear with the requests: one per stream, lane (a streamed chat is interactive) and
    # client shown, never the prompt.
    first = until(wait, rows, lambda r: len(r) == STREAMS and all(x["state"] == "decoding" for x in r))
    assert all("interactive" in r["text"] and "openai /v1/chat/completions" in r["text"] for r in first), first
    assert not any("Tell story" in r["text"] for r in first)
    # ...progress while they run...
    before = {r["id"]: r["generated"] for r in first}
    until(wait, rows, lambda r: any(x["id"] in before and x["generated"] > before[x["id"]] for x in r))
    for s in streams:
        s.thread.join(LIVE_S * 2)
    assert not any(s.thread.is_alive() for s in streams)
    # ...and go with them.
    until(wait, lambda d: [d.execute_script(ROWS)], lambda r: r[0] == [])

    ttfts = sorted(s.ttft for s in streams)
    gaps = sorted(g for s in streams for g in s.gaps)
    shown = until(wait, lambda d: d.execute_script(LATENCY, MODEL),
                  lambda f: f["ttft.1m.all.n"] == str(STREAMS) and int(f["itl.1m.all.n"]) >= len(gaps) - STREAMS)
    # Every token the clients got is one sample (a chunk the detokenizer held back for a split
    # character would be two gaps on the server's side and one on the client's: a few at most).
    assert abs(int(shown["itl.1m.all.n"]) - len(gaps)) <= STREAMS, (shown, len(gaps))
    # The client's TTFT also holds its request's way in (connect, send, the event loop serving 4
    # streams before it reads the headers): up to a few % of a 2-second TTFT on the shared 2 cores.
    # A gap between two chunks carries only jitter, both ways: a write or a read that ran late
    # lengthens one gap and shortens the next by as much. That leaves the median where it was, but
    # on a busy machine it spreads the tail: a CI run saw shown p95 78 ms against the clients' 91 ms,
    # with p50 within 1 ms. So the shown p95 must lie within the clients' p92..p98 (ranks that jitter
    # may swap), give or take 3 ms, while the median stays within 3 ms.
    for name, samples, allowance in (("ttft", ttfts, lambda v: max(60.0, 0.05 * v)), ("itl", gaps, lambda v: 3.0)):
        for q, p in (("p50", 0.5), ("p95", 0.95)):
            spread = 0.03 if (name, q) == ("itl", "p95") else 0.0
            low, high = (percentile(samples, p + d) * 1000 for d in (-spread, spread))
            server_ms = shown_ms(shown[f"{name}.1m.all.{q}"])
            print(f"{name} {q}: shown {server_ms} ms, clients' {percentile(samples, p) * 1000:.2f} ms"
                  f" ({low:.2f}..{high:.2f})")
            slack = 0.5 + allowance(high)
            assert low - slack <= server_ms <= high + slack, (name, q, server_ms, low, high)
    # Per lane: an interactive row, none for lanes without samples.
    assert shown["ttft.1m.interactive.n"] == str(STREAMS) and "ttft.1m.default.n" not in shown
    assert shown["step.1m.all.n"] != "0" and shown["queue.1m.all.n"] == str(STREAMS)
    traffic = page.execute_script("return window.__dashboard.last.traffic")
    assert {"dialect": "openai", "route": "/v1/chat/completions", "requests": STREAMS} in traffic, traffic


def test_cancelling_a_row_ends_its_stream(page, daemon, no_eog, clean_console):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    page.get(url + "/#scheduler")
    wait = WebDriverWait(page, LIVE_S, poll_frequency=0.1)
    stream = TimedStream(url, key, {"model": MODEL, "max_tokens": 700, "logit_bias": no_eog,
                                    "messages": [{"role": "user", "content": "Write a very long story."}]}).start()
    row = until(wait, lambda d: d.execute_script(ROWS), lambda r: len(r) == 1 and r[0]["generated"] > 2)[0]
    page.find_element(By.CSS_SELECTOR, f'.seqs tr[data-request="{row["id"]}"] button.cancel').click()
    stream.thread.join(LIVE_S)
    assert not stream.thread.is_alive()
    # OpenAI's way to end a stream the server stopped: an error frame, here saying who stopped it,
    # then a last chunk whose finish_reason is "error" (clients that wait for one do not hang).
    (error,) = [f["error"] for f in stream.frames if "error" in f]
    assert error["code"] == "request_cancelled" and "dashboard" in error["message"], error
    assert stream.frames[-1]["choices"][0]["finish_reason"] == "error", stream.frames[-1]
    assert len(stream.arrivals) < 700
    until(wait, lambda d: [d.execute_script(ROWS)], lambda r: r[0] == [])
    # A request that is not running: a 404 in the page's own dialect, nothing cancelled.
    request = urllib.request.Request(url + "/api/dashboard/requests/req-nope/cancel", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=LIVE_S)
    assert e.value.code == 404 and "req-nope" in json.loads(e.value.read())["error"]


FIGURES = """
const card = document.querySelector(`.card[data-model^="${arguments[0]}"]`);
if (!card) return null;
const out = {};
for (const e of card.querySelectorAll("[data-field]")) out[e.dataset.field] = e.textContent;
return out;"""


def until(wait: Any, read: Callable[[Any], Any], ok: Callable[[Any], bool]) -> Any:
    """The first value of read(driver) that passes ok, within the wait's bound."""
    def check(driver: Any) -> Any:
        value = read(driver)
        return value if value and ok(value) else None

    return wait.until(check)


HISTORY = """
const name = Object.keys(window.__dashboard.history).find((n) => n.startsWith(arguments[0]));
return name ? window.__dashboard.history[name].tps.length : 0;"""


def figures(page: Any) -> dict[str, str] | None:
    return page.execute_script(FIGURES, MODEL)


def busy(f: dict[str, str]) -> bool:
    return float(f["tps"]) > 0 and int(f["lane-default"]) > 0 and int(f["running"].split("/")[0]) > 0


def test_scheduler_view_moves_under_load(page, daemon, clean_console):
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    page.get(url + "/#scheduler")
    wait = WebDriverWait(page, LIVE_S, poll_frequency=0.1)
    idle = wait.until(lambda d: figures(d))
    assert idle["lane-default"] == "0" and idle["running"].startswith("0 /"), idle

    def chat(i: int) -> None:
        # Of different lengths, so some finish (and show their TTFT) while the others run; the
        # last one in the batch lane.
        call(url + "/v1/chat/completions", key, {"model": MODEL, "max_tokens": 48 + 24 * i, "temperature": 0.8, "seed": i,
                                                 "messages": [{"role": "user", "content": f"Tell story number {i}"}]},
             lane="batch" if i == CHATS - 1 else None)

    threads = [threading.Thread(target=chat, args=(i,), daemon=True) for i in range(CHATS)]
    for t in threads:
        t.start()
    try:
        # A snapshot taken after this load's first steps: lanes, running and tok/s all show it (the
        # idle read may still show the previous test's rate, for the rate's 10 s window).
        loaded = until(wait, figures, lambda f: busy(f) and int(f["steps"]) > int(idle["steps"]))
        assert loaded["lane-default"] != idle["lane-default"] and loaded["running"] != idle["running"]
        # And it keeps moving while the load runs: the next snapshots count more engine steps.
        later = until(wait, figures, lambda f: int(f["steps"]) > int(loaded["steps"]))
        assert float(later["tps"]) > 0
        if key is None:
            # A few seconds of chart history, and some answers' latencies while the rest still run,
            # make a picture worth looking at.
            wait.until(lambda d: d.execute_script(HISTORY, MODEL) >= 8)
            until(wait, lambda d: [figures(d), d.execute_script(ROWS)], lambda v: v[0]["ttft"] != "– / –" and len(v[1]) >= 2)
            save_screenshot(page)
    finally:
        for t in threads:
            t.join(LIVE_S * 2)
    assert not any(t.is_alive() for t in threads)


def save_screenshot(page: Any) -> None:
    """The README's picture, as a 64-colour PNG: a few tens of kB instead of a few hundred."""
    from PIL import Image

    image = Image.open(io.BytesIO(page.get_screenshot_as_png())).convert("RGB")
    SCREENSHOT.parent.mkdir(exist_ok=True)
    image.quantize(colors=64).save(SCREENSHOT, optimize=True)


def test_chat_playground_streams_and_stops(page, daemon, clean_console):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    url, key = daemon
    page.get(url + "/#chat")
    wait = WebDriverWait(page, LIVE_S, poll_frequency=0.05)
    names = wait.until(lambda d: [o.text for o in Select(d.find_element(By.ID, "chat-model")).options])
    Select(page.find_element(By.ID, "chat-model")).select_by_visible_text(next(n for n in names if n.startswith(MODEL)))
    Select(page.find_element(By.ID, "chat-lane")).select_by_visible_text("interactive")
    temperature = page.find_element(By.ID, "chat-temp")
    temperature.clear()
    temperature.send_keys("0")
    page.find_element(By.ID, "chat-input").send_keys("Write a very long story about a lighthouse keeper.")
    page.find_element(By.ID, "chat-send").click()

    answer = lambda d: d.execute_script("const a = document.querySelector('#chat-log .assistant'); "  # noqa: E731
                                        "return a ? [a.textContent, a.dataset.done || ''] : null")
    # Streamed: the answer shows up in pieces, before it is done.
    first = until(wait, answer, lambda a: bool(a[0]))
    grown = until(wait, answer, lambda a: len(a[0]) > len(first[0]))
    assert first[1] == "" and grown[0].startswith(first[0])
    assert page.find_element(By.ID, "chat-send").get_attribute("disabled")

    page.find_element(By.ID, "chat-stop").click()
    stopped = until(wait, answer, lambda a: a[1] == "1")
    assert page.find_element(By.ID, "chat-stop").get_attribute("disabled")
    assert not page.find_element(By.ID, "chat-send").get_attribute("disabled")
    # Stopped means the daemon freed the sequence, and the text grows no more.
    deadline = time.monotonic() + LIVE_S
    while any(m["running"] for m in call(url + "/api/dashboard/state", key)["models"]):
        assert time.monotonic() < deadline, "the stopped chat still runs"
        time.sleep(0.1)
    assert answer(page)[0] == stopped[0] and "error" not in page.find_element(By.CSS_SELECTOR, "#chat-log > div:last-child").get_attribute("class")


def test_pull_shows_progress(page, daemon, files, clean_console):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    page.get(url + "/#pull")
    page.find_element(By.ID, "pull-name").send_keys(f"{files.url}/files/dash-pull.gguf")
    page.find_element(By.CSS_SELECTOR, "#pull-form button").click()
    wait = WebDriverWait(page, LIVE_S, poll_frequency=0.05)
    assert wait.until(lambda d: d.find_element(By.ID, "pull-progress").is_displayed())
    wait.until(lambda d: d.find_element(By.ID, "pull-status").text in ("success",) or
               d.find_element(By.ID, "pull-status").text.startswith("failed"))
    assert page.find_element(By.ID, "pull-status").text == "success"
    seen = page.execute_script("return window.__dashboard.pullSeen")
    # Several steps on the way up, ending full: progress, not a bar that jumps to done.
    assert len(set(seen)) >= 3 and seen == sorted(seen) and seen[-1] == 100 and seen[0] < 50, seen
    assert page.find_element(By.ID, "pull-progress").get_attribute("value") == "100"
    installed = wait.until(lambda d: [r.get_attribute("data-model") for r in
                                      d.find_elements(By.CSS_SELECTOR, "#installed tbody tr")] or None)
    assert "dash-pull:latest" in installed, installed
    assert "dash-pull:latest" in [m["name"] for m in call(url + "/api/tags", key)["models"]]


BATCH_ROW = """
const row = document.querySelector(`#batches tr[data-batch="${arguments[0]}"]`);
if (!row) return null;
const bar = row.querySelector("progress");
return {status: row.dataset.status, text: row.textContent, value: bar.getAttribute("value"),
        max: bar.getAttribute("max"), cancel: !!row.querySelector("button.cancel")};"""


def test_batches_list_shows_progress(page, daemon, clean_console):
    """A batch submitted through the official client shows up in the Batches tab, its progress bar
    moves while the lines run, and it ends completed with every line counted."""
    import openai
    from selenium.webdriver.support.ui import WebDriverWait

    url, key = daemon
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 48, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"Describe city number {i}"}]}})
             for i in range(BATCH_LINES)]
    client = openai.OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0)
    upload = client.files.create(file=("dash.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    page.get(url + "/#batches")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    # The rows are redrawn on every poll: read them whole in the page, never hold an element.
    read = lambda d: d.execute_script(BATCH_ROW, batch.id)  # noqa: E731
    wait = WebDriverWait(page, LIVE_S * 3, poll_frequency=0.1)
    done = until(wait, read, lambda r: r["status"] == "completed")
    assert f"{BATCH_LINES} / {BATCH_LINES}" in done["text"] and "failed)" not in done["text"], done
    assert done["value"] == done["max"] == str(BATCH_LINES) and not done["cancel"], done  # nothing left to cancel
    seen = page.execute_script("return window.__dashboard.batchSeen[arguments[0]]", batch.id)
    # Counted up on the way, not a row that jumps from nothing to done.
    assert seen == sorted(seen) and seen[-1] == BATCH_LINES and any(0 < n < BATCH_LINES for n in seen), seen
    assert client.batches.retrieve(batch.id).request_counts.completed == BATCH_LINES

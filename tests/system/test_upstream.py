"""Remote upstreams (issue 14) with real daemons: two localserve daemons act as upstreams (A with an
API key, B without), a third fronts them. Through the front daemon the official `openai` client
lists, streams, completes and embeds with the remote model and gets the upstream's own greedy
answers; a disconnect cancels the upstream's sequence; interactive requests overtake queued batch
ones under A's concurrency limit of 1; B going down mid-run is taken out and requests fail over
to A; A's key never reaches a response, a log line or `localserve config`.

Model names: "remote-smol" is served by B then A (B first, so sequential requests use B while it
is up, least-outstanding breaking ties in config order); "solo-smol" by A only.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import audio_model
from daemon_util import cli, cli_env, free_port, http_get, register_model, start_serve, stop_quietly, wait_published
import vision_model

openai = pytest.importorskip("openai")

KEY = "sk-upstream-test-7f3a9c"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def daemons(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    procs = []
    homes = {}
    try:
        for name, extra in (("a", {"LOCALSERVE_API_KEY": KEY}), ("b", {})):
            home = tmp_path_factory.mktemp(f"upstream-{name}")
            env = cli_env(home, free_port(), **extra)
            register_model(env, smollm2_gguf)
            proc = start_serve(env)
            procs.append((env, proc))
            homes[name] = (home, env, wait_published(home, proc)["url"])
        front_home = tmp_path_factory.mktemp("front")
        config = front_home / "config.toml"
        config.write_text(f"""
upstream_health_interval = 1.0
[[upstreams]]
name = "b"
url = "{homes['b'][2]}/v1"
models = ["smollm2-135m=remote-smol"]
max_concurrency = 1

[[upstreams]]
name = "a"
url = "{homes['a'][2]}/v1/"
api_key_env = "UPSTREAM_A_KEY"
models = ["smollm2-135m=remote-smol", "smollm2-135m=solo-smol"]
max_concurrency = 1
""")
        env = cli_env(front_home, free_port(), LOCALSERVE_CONFIG=str(config), UPSTREAM_A_KEY=KEY)
        proc = start_serve(env)
        procs.append((env, proc))
        front = wait_published(front_home, proc)["url"]
        yield {"front": front, "front_env": env, "front_home": front_home, "front_proc": proc,
               "a": homes["a"][2], "b": homes["b"][2], "b_proc": procs[1][1], "b_env": homes["b"][1]}
    finally:
        for env, proc in procs:
            stop_quietly(env, proc)


def client(url: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ps(url: str, key: str | None = None) -> dict:
    req = urllib.request.Request(url + "/api/ps", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_openai_client_lists_streams_completes_and_embeds_like_the_upstream(daemons):
    front, direct = client(daemons["front"]), client(daemons["a"], KEY)
    listed = {m.id: m for m in front.models.list().data}
    assert {"remote-smol", "solo-smol"} <= set(listed)
    assert listed["solo-smol"].owned_by == "remote:a" and listed["remote-smol"].model_extra["remote"] is True
    tags = json.loads(http_get(daemons["front"] + "/api/tags")[1])["models"]
    assert {t["name"]: t["remote_host"] for t in tags if t.get("remote_model")}["solo-smol"] == "a"

    want = direct.chat.completions.create(model="smollm2-135m", messages=MESSAGES, temperature=0, max_tokens=24)
    got = front.chat.completions.create(model="solo-smol", messages=MESSAGES, temperature=0, max_tokens=24)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens and got.usage.completion_tokens == want.usage.completion_tokens
    assert got.model == "solo-smol"

    chunks = list(front.chat.completions.create(model="solo-smol", messages=MESSAGES, temperature=0, max_tokens=24,
                                                stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 3  # passed through token by token, not as one lump
    assert "".join(deltas) == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens

    prompt = "The capital of France is"
    want_c = direct.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=12)
    got_c = front.completions.create(model="solo-smol", prompt=prompt, temperature=0, max_tokens=12)
    assert got_c.choices[0].text == want_c.choices[0].text and got_c.usage.total_tokens == want_c.usage.total_tokens

    want_e = direct.embeddings.create(model="smollm2-135m", input=["hello there", "bonjour"])
    got_e = front.embeddings.create(model="solo-smol", input=["hello there", "bonjour"])
    assert [d.embedding for d in got_e.data] == [d.embedding for d in want_e.data]
    assert got_e.usage.prompt_tokens == want_e.usage.prompt_tokens > 0


def test_upstream_refusal_reaches_the_client_in_our_shape_without_the_key(daemons):
    front = client(daemons["front"])
    long_prompt = "word " * 3000  # past the upstream's 1024-token context: its 400, relayed
    with pytest.raises(openai.BadRequestError) as err:
        front.chat.completions.create(model="solo-smol", messages=[{"role": "user", "content": long_prompt}])
    body = err.value.body
    assert "upstream a" in body["message"] and KEY not in json.dumps(body)
    with pytest.raises(openai.BadRequestError) as err:  # tools are refused, not silently dropped
        front.chat.completions.create(model="solo-smol", messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert err.value.body["param"] == "tools"
    # Images and audio are not relayed: a 400 naming the part and what it is.
    png, wav = (base64.b64encode(data).decode() for data in (vision_model.test_image(1), audio_model.test_audio(1)))
    for part, kind in (({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}, "is an image"),
                       ({"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}, "is audio")):
        with pytest.raises(openai.BadRequestError) as err:
            front.chat.completions.create(model="solo-smol", messages=[{"role": "user", "content": [part]}])
        assert f"{kind}, and the remote model 'solo-smol' is sent text only" in err.value.body["message"]
        assert err.value.body["param"].startswith("messages[0].content[0]")
    # The Ollama dialect needs our tokenizer: a clear 400 in Ollama's shape.
    req = urllib.request.Request(daemons["front"] + "/api/generate", method="POST",
                                 data=json.dumps({"model": "solo-smol", "prompt": "hi"}).encode())
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=30)
    assert http_err.value.code == 400 and "upstream a" in json.loads(http_err.value.read())["error"]


def test_disconnect_cancels_the_upstream_request(daemons):
    front = client(daemons["front"])
    stream = front.chat.completions.create(
        model="solo-smol", stream=True, max_tokens=900, temperature=1.0, seed=3,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}])
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert ps(daemons["a"], KEY)["models"][0]["running"] == 1
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 15  # liveness bound; the answer would run 900 tokens otherwise
    while ps(daemons["a"], KEY)["models"][0]["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ps(daemons["a"], KEY)["models"][0]["running"] == 0
    assert ps(daemons["front"])["upstreams"][1]["outstanding"] == 0


def test_interactive_overtakes_queued_batch_requests_on_a_limited_upstream(daemons):
    front = client(daemons["front"])
    finished: list[str] = []
    lock = threading.Lock()

    def ask(tag: str, lane: str, tokens: int) -> None:
        # The blocker's end tokens are banned: SmolLM2 names three colors in a dozen tokens, and a
        # blocker that ends before the batch requests queue leaves nothing to overtake.
        bias = {"0": -100, "1": -100, "2": -100} if tag == "blocker" else openai.NOT_GIVEN
        front.chat.completions.create(model="solo-smol", messages=MESSAGES, max_tokens=tokens, temperature=0,
                                      logit_bias=bias, extra_headers={"X-Priority": lane})
        with lock:
            finished.append(tag)

    def waiting() -> dict:
        rows = [m for m in ps(daemons["front"])["models"] if m["name"] == "solo-smol"]
        return rows[0]["waiting"] if rows else {}

    threads = [threading.Thread(target=ask, args=("blocker", "default", 240))]
    threads[0].start()
    deadline = time.monotonic() + 30
    while ps(daemons["a"], KEY)["models"][0]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(3):
        threads.append(threading.Thread(target=ask, args=(f"batch{i}", "batch", 8)))
        threads[-1].start()
    while waiting().get("batch") != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting()["batch"] == 3  # queued here, under A's limit of 1, not at the upstream
    threads.append(threading.Thread(target=ask, args=("interactive", "interactive", 8)))
    threads[-1].start()
    for t in threads:
        t.join(120)
    assert finished[:2] == ["blocker", "interactive"], finished


def test_failed_upstream_is_taken_out_and_requests_fail_over(daemons):
    front = client(daemons["front"])
    answers = []
    for i in range(4):
        if i == 2:
            daemons["b_proc"].kill()  # B goes down mid-run
            daemons["b_proc"].wait(10)
        r = front.chat.completions.create(model="remote-smol", messages=MESSAGES, temperature=0, max_tokens=8)
        answers.append(r.choices[0].message.content)
    assert len(set(answers)) == 1  # the same model answers alike wherever it ran
    states = {u["name"]: u for u in ps(daemons["front"])["upstreams"]}
    assert states["b"]["state"] == "down" and states["b"]["served"] == 2 and states["a"]["state"] == "up"
    metrics = http_get(daemons["front"] + "/metrics")[1].decode()
    assert 'localserve_upstream_up{upstream="b"} 0.0' in metrics
    assert 'localserve_upstream_up{upstream="a"} 1.0' in metrics


def test_the_key_never_shows(daemons):
    for path in ("/api/ps", "/metrics", "/v1/models", "/api/tags", "/api/dashboard/state"):
        assert KEY not in http_get(daemons["front"] + path)[1].decode()
    shown = cli(daemons["front_env"], "config")
    assert shown.returncode == 0 and KEY not in shown.stdout and "UPSTREAM_A_KEY" in shown.stdout.replace("\n", "")
    logs = "".join(p.read_text(errors="replace") for p in (daemons["front_home"] / "logs").glob("*"))
    assert "upstream b taken out" in logs and KEY not in logs

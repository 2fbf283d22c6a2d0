"""Same bytes through the socket: the real server (`python -m nanolab serve`, a subprocess on a
free port) driven by the official `openai` client gives the greedy text `LLM.generate` gives, for
completions and chat, streamed and whole, with requests joining mid-flight, on the reference read
and on the streamed one. SIGTERM with a request in flight aborts it, and the server exits cleanly
with every block free."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import needs_smollm2

from nanolab import LLM, SamplingParams

openai = pytest.importorskip("openai", reason="the openai client is installed by scripts/setup.sh")

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]
CHATS = [[{"role": "user", "content": "What is the capital of Italy?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."}]]


class Server:
    """`python -m nanolab serve` on a port the OS picks; its log is collected as it runs."""

    def __init__(self, *args: str, model: str = MODEL) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "nanolab", "serve", "--model", model, "--device", "cpu",
                                      "--port", "0", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        started = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                match = re.search(r"serving \S+ at (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    started.set()
            started.set()

        threading.Thread(target=read, daemon=True).start()
        if not started.wait(180) or self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-20:]))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        time.sleep(0.1)  # let the reader thread take the last lines
        return code

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


def complete(client, prompt, stream: bool, max_tokens: int) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    chunks = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat(client, messages, stream: bool, max_tokens: int) -> str:
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def joined_by_index(chunks, text) -> list[str]:
    """A stream of n choices' chunks joined into each choice's text, by the index each chunk names."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (text(choice) or "")
    return [texts[i] for i in sorted(texts)]


def expected(read: str, max_tokens: int, prompts, chats, sampled: SamplingParams | None = None):
    """Greedy texts of `prompts` and `chats` from `LLM.generate`; with `sampled`, also the first
    prompt's `RequestOutput` under those params."""
    llm = LLM(MODEL, device="cpu", read=read, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts = ([o.text for o in llm.generate(prompts, params, use_tqdm=False)],
             [o.text for o in llm.chat(chats, params, use_tqdm=False)])
    return texts if sampled is None else (*texts, llm.generate(prompts[0], sampled, use_tqdm=False)[0])


def assert_clean_exit(server: Server, aborted: int = 0) -> None:
    assert server.stop() == 0, server.log
    match = re.search(r"stopped \((\d+) requests aborted; (\d+) of (\d+) KV blocks free\)", server.log)
    assert match, server.log
    assert int(match.group(1)) == aborted and match.group(2) == match.group(3), server.log


@needs_smollm2
@pytest.mark.slow
def test_same_text_through_the_socket_reference_read():
    sampled = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6, logprobs=2)
    want_prompts, want_chats, want_samples = expected("reference", 12, PROMPTS, CHATS, sampled)
    server = Server("--read", "reference")
    try:
        client = server.client
        assert [m.id for m in client.models.list().data] == [MODEL]
        # The first stream runs while the others join it mid-flight.
        with ThreadPoolExecutor(12) as pool:
            first = pool.submit(complete, client, PROMPTS[0], True, 12)
            time.sleep(0.3)
            jobs = [(want_prompts[i], pool.submit(complete, client, p, stream, 12))
                    for stream in (False, True) for i, p in enumerate(PROMPTS)]
            jobs += [(want_chats[i], pool.submit(chat, client, m, stream, 12))
                     for stream in (False, True) for i, m in enumerate(CHATS)]
            # The same conversation as clients that send content as a list of text parts, with a name.
            parts = [{**m, "content": [{"type": "text", "text": m["content"]}], "name": "reader"} for m in CHATS[0]]
            jobs += [(want_chats[0], pool.submit(chat, client, parts, stream, 12)) for stream in (False, True)]
            assert first.result() == want_prompts[0]
            for want, job in jobs:
                assert job.result() == want
        # Two seeded samples with logprobs, alone: generate's tokens and numbers.
        reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0.8, seed=7, n=2,
                                          logprobs=2)
        assert [c.text for c in reply.choices] == [o.text for o in want_samples.outputs]
        for choice, out in zip(reply.choices, want_samples.outputs):
            assert choice.logprobs.token_logprobs == pytest.approx([e[0] for e in out.logprobs], abs=1e-4)
        # The same two samples streamed, each chunk naming its choice; and chat's two, whole and streamed.
        streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0.8, seed=7,
                                             n=2, stream=True)
        assert joined_by_index(streamed, lambda c: c.text) == [c.text for c in reply.choices]
        kw = dict(model=MODEL, messages=CHATS[1], max_tokens=6, temperature=0.8, seed=7, n=2)
        whole_chat = client.chat.completions.create(**kw)
        assert [c.index for c in whole_chat.choices] == [0, 1]
        assert joined_by_index(client.chat.completions.create(**kw, stream=True), lambda c: c.delta.content) \
            == [c.message.content for c in whole_chat.choices]
        # Chat's logprobs, streamed: an entry with its top 3 on every token's chunk.
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=12, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert "".join(e.token for e in entries).removesuffix("<|im_end|>") == want_chats[0]  # EOS is scored too
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in entries)
    finally:
        assert_clean_exit(server)
    assert len(re.findall(r"POST /v1/(chat/)?completions 200", server.log)) == 20  # one log line per request


@needs_smollm2
@pytest.mark.slow
def test_same_text_through_the_socket_streamed_read():
    """The streamed Triton read (in the interpreter on a CPU: slow, so two short requests)."""
    want_prompts, want_chats = expected("streamed", 3, PROMPTS[:1], CHATS[:1])
    server = Server("--read", "streamed")
    try:
        with ThreadPoolExecutor(2) as pool:
            text = pool.submit(complete, server.client, PROMPTS[0], True, 3)
            reply = pool.submit(chat, server.client, CHATS[0], False, 3)
            assert text.result() == want_prompts[0] and reply.result() == want_chats[0]
    finally:
        assert_clean_exit(server)


@needs_smollm2
@pytest.mark.slow
def test_sigterm_aborts_what_is_in_flight_and_frees_every_block():
    server = Server("--read", "reference", "--shutdown-timeout", "0", "--api-key", "k")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    chunks = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(chunks))
    assert first.choices[0].finish_reason is None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    server.proc.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "abort"
    assert_clean_exit(server, aborted=1)


@pytest.mark.slow
def test_a_dead_engine_process_is_reported():
    """The engine core runs in a child process. When it dies, /health says so (503), new requests
    get a 503, and the server exits with code 1 and one error line on SIGTERM."""
    server = Server(model="tiny")
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True,
                              text=True).stdout.split()
    engines = [int(p) for p in children
               if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
    assert len(engines) == 1, children
    assert urllib.request.urlopen(server.url + "/health").status == 200
    os.kill(engines[0], signal.SIGKILL)
    for _ in range(100):
        try:
            urllib.request.urlopen(server.url + "/health")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            break
        time.sleep(0.05)
    else:
        pytest.fail("/health stayed 200 after the engine process died")
    with pytest.raises(openai.APIStatusError) as refused:
        server.client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 503
    assert server.stop() == 1
    assert "error: nanolab stopped after the engine died" in server.log


@needs_smollm2
@pytest.mark.slow
def test_same_text_through_the_socket_at_tensor_parallel_size_2():
    """Two gloo ranks behind the server: the engine core process starts its worker and the text
    is one process's; SIGTERM sends the worker home and the server still exits cleanly."""
    want_prompts, want_chats = expected("reference", 8, PROMPTS[:2], CHATS[:1])
    server = Server("--read", "reference", "--tensor-parallel-size", "2")
    try:
        with ThreadPoolExecutor(3) as pool:
            texts = [pool.submit(complete, server.client, p, s, 8) for p, s in zip(PROMPTS[:2], (True, False))]
            reply = pool.submit(chat, server.client, CHATS[0], True, 8)
            assert [t.result() for t in texts] == want_prompts and reply.result() == want_chats[0]
    finally:
        assert_clean_exit(server)

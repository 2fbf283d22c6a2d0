"""The server under test: an arm's name, the `python -m nanolab serve` command line it runs, and
the subprocess started, waited for and stopped around a bench. Day 58.

An arm is a graphs mode, "graphs" (CUDA graphs as the server's default has them: decode steps),
"fullgraphs" (`--cudagraph-mode full`: varlen steps too) or "eager" (`--enforce-eager`),
optionally ending
in its prefill: "-chunked" (`--enable-chunked-prefill`) or "-whole" (`--no-enable-chunked-prefill`);
a bare arm takes the server's default, chunked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from nanolab.config import EngineConfig, SpeculativeConfig

ARMS = ("graphs", "fullgraphs", "eager")
GRAPHED = ("graphs", "fullgraphs")  # the modes that capture decode graphs
DEFAULT_ARMS = ("graphs", "eager")  # what a bench runs unless told: Day 58's comparison
PREFILLS = ("chunked", "whole")  # an arm's optional suffix: the server's prefill
SPECULATIONS = ("ngram",)  # an arm's optional "+" suffix: the server's speculative method (Day 65)
# The server's token budget a step unless told (`serve --max-num-batched-tokens`'s default), as the table
# records it.
SERVER_TOKEN_BUDGET = EngineConfig.max_num_batched_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_arm(arm: str) -> tuple[str, str | None]:
    """An arm's graphs mode and prefill: "graphs-whole" -> ("graphs", "whole"); "eager" ->
    ("eager", None), the server's default prefill. Either may end in "+ngram", with settings
    (`split_speculation`)."""
    base, plus, spec = arm.partition("+")
    mode, _, prefill = base.partition("-")
    if mode not in ARMS or prefill not in ("", *PREFILLS) or (plus and spec.partition(":")[0] not in SPECULATIONS):
        raise ValueError(f"unknown arm {arm!r}: one of {ARMS}, optionally ending in -{' or -'.join(PREFILLS)}, "
                         f"then optionally +{' or +'.join(SPECULATIONS)}, with :field=value settings")
    if plus:
        _speculative_config(arm, spec)
    return mode, prefill or None


def _speculative_config(arm: str, spec: str) -> dict:
    """"ngram:prompt_lookup_min=2:num_speculative_tokens=8" -> the `speculative_config` dict, its
    settings checked as `SpeculativeConfig` checks them (a bad one is refused by its field's name)."""
    method, *settings = spec.split(":")
    config = {"method": method}
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {"method"}
    for setting in settings:
        name, eq, value = setting.partition("=")
        if name not in fields or not eq or not re.fullmatch(r"-?[0-9]+", value, re.ASCII):
            raise ValueError(f"arm {arm!r}: {setting!r} is not a setting: field=int, the field one of "
                             f"{', '.join(sorted(fields))}")
        if name in config:
            raise ValueError(f"arm {arm!r}: {name} is set twice")
        config[name] = int(value)
    try:
        SpeculativeConfig(**config)
    except ValueError as e:
        raise ValueError(f"arm {arm!r}: {e}") from None
    return config


def split_speculation(arm: str) -> tuple[str, dict | None]:
    """An arm without its speculation, and the server's `speculative_config` for it:
    "graphs+ngram" -> ("graphs", {"method": "ngram"}), prompt lookup with the config's defaults;
    "graphs+ngram:prompt_lookup_min=2" -> ("graphs", {"method": "ngram", "prompt_lookup_min": 2});
    an arm without the suffix -> (arm, None)."""
    split_arm(arm)
    plain, plus, spec = arm.partition("+")
    return plain, _speculative_config(arm, spec) if plus else None


def serve_command(model: str, port: int, *, device: str, eager: bool, step_log: Path, dtype: str = "auto",
                  read: str = "auto", max_num_seqs: int = 64, max_model_len: int | None = None,
                  max_waiting: int = 1024, chunked_prefill: bool | None = None,
                  max_num_batched_tokens: int | None = None, cudagraph_mode: str | None = None,
                  prefix_caching: bool | None = None, speculative_config: dict | None = None) -> list[str]:
    """`python -m nanolab serve` on loopback with a step log. `max_waiting` is set above any rate's
    request count: a bench past saturation measures the queue, not the server's 503s.
    `chunked_prefill` None leaves the server's default; `max_num_batched_tokens`, the tokens a step
    feeds, None the server's default; `cudagraph_mode` and `prefix_caching` (Day 64) likewise;
    `speculative_config` (Day 65), given as JSON."""
    argv = [sys.executable, "-m", "nanolab", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--device", device, "--dtype", dtype, "--read", read, "--max-num-seqs", str(max_num_seqs),
            "--max-waiting", str(max_waiting), "--step-log", str(step_log)]
    if eager:
        argv.append("--enforce-eager")
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill")
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if cudagraph_mode is not None:
        argv += ["--cudagraph-mode", cudagraph_mode]
    if prefix_caching is not None:
        argv.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    return argv


class ServeProcess:
    """A server subprocess on `port`: started and waited for (`GET /health` is 200) on enter,
    stopped with SIGTERM on exit. Its stdout and stderr go to `log`; an early death raises with the
    log's tail. `exit_code` is what it returned to SIGTERM (-9 if it had to be killed)."""

    def __init__(self, argv: list[str], port: int, log: Path, start_timeout_s: float = 600.0,
                 stop_timeout_s: float = 60.0) -> None:
        self.argv, self.port, self.log = argv, port, Path(log)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.ready_s: float | None = None  # seconds from launch to the first healthy answer

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}; the end of its log "
                               f"({self.log}):\n{self.tail()}")

    def __enter__(self) -> ServeProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        launched = time.monotonic()
        while not self._healthy():
            try:
                self.check_alive()
            except RuntimeError:
                self.proc = None
                raise
            if time.monotonic() - launched > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"the server was not healthy within {self.start_timeout_s:.0f} s; the end of "
                                   f"its log ({self.log}):\n{self.tail()}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - launched
        return self

    def model_id(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as resp:
            return json.load(resp)["data"][0]["id"]

    def metrics(self) -> dict[str, float] | None:
        """`scrape_metrics` of this server."""
        return scrape_metrics(self.url)

    def stop(self) -> int | None:
        """SIGTERM, and wait; kill after `stop_timeout_s`."""
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape_metrics(url: str) -> dict[str, float] | None:
    """The `GET /metrics` of the server at `url`, each sample by name (`parse_metrics`), or None
    where it has none (404)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition by its name, summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values

"""`python -m nanolab`: generate and weights on the tiny preset, and how bad input is refused
(exit code 2, one `error:` line on stderr, no traceback)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanolab.__main__ as cli
from nanolab.model.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def nanolab(*args: str, without: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh interpreter; `without` names a module made unimportable there."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "nanolab", *args]
    if without is not None:
        command = [sys.executable, "-c", f"import sys; sys.modules[{without!r}] = None; "
                   "from nanolab.__main__ import main; sys.exit(main(sys.argv[1:]))", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = error_lines(result.stderr)
    for needle in needles:
        assert needle in line, result.stderr


def test_generate_streams_a_completion() -> None:
    result = nanolab("generate", "hello", "--model", "tiny", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip(), "nothing was printed"


def test_generate_chat() -> None:
    result = nanolab("generate", "hello", "--chat", "--model", "tiny", "--max-tokens", "5", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # The tiny preset's random weights may well produce only whitespace; the run still ends its line.
    assert result.stdout.endswith("\n")


def test_weights_prints_the_folder() -> None:
    result = nanolab("weights", "tiny")
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize("flag,value,field", [("--max-tokens", "0", "max_tokens"),
                                              ("--temperature", "-1", "temperature")])
def test_generate_refuses_bad_sampling_params(flag: str, value: str, field: str) -> None:
    assert_refused(nanolab("generate", "hello", "--model", "tiny", flag, value), field)


def test_generate_refuses_an_unknown_preset_naming_the_presets() -> None:
    assert_refused(nanolab("generate", "hello", "--model", "no-such-preset"), "no-such-preset", *PRESETS)


def test_weights_refuses_an_unknown_preset_naming_the_presets() -> None:
    assert_refused(nanolab("weights", "no-such-preset"), "no-such-preset", *PRESETS)


def test_generate_refuses_an_empty_prompt() -> None:
    result = nanolab("generate", "", "--model", "tiny")
    assert_refused(result, "prompt is empty")
    assert not result.stdout.strip()


# In-process: main returns the exit code, so these need no interpreter start-up each.

def assert_refused_in_process(capsys, argv: list[str], *needles: str) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not out.strip()
    (line,) = error_lines(err)
    for needle in needles:
        assert needle in line, err


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "0.001", "use 0 for greedy"),
                                               ("--temperature", "nan", "temperature"),
                                               ("--seed", str(2**64), "SamplingParams.seed"),
                                               ("--top-k", "-5", "top_k"),
                                               ("--dtype", "float8", "dtype"),
                                               # argparse's own refusals, in the same one line
                                               ("--max-tokens", "x", "generate: argument --max-tokens: invalid int"),
                                               ("--read", "nope", "argument --read: invalid choice: 'nope'"),
                                               ("--no-such-flag", "1", "unrecognized arguments: --no-such-flag")])
def test_generate_refuses_bad_input_in_one_line(capsys, flag: str, value: str, needle: str) -> None:
    assert_refused_in_process(capsys, ["generate", "hello", "--model", "tiny", flag, value], needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_generate_refuses_cuda_on_a_machine_without_it(capsys) -> None:
    assert_refused_in_process(capsys, ["generate", "hello", "--model", "tiny", "--device", "cuda"],
                              "device='cuda'", "CUDA is not available")


def test_generate_and_weights_need_no_lab_extra() -> None:
    # pandas comes with the lab extra only; the lab's benches say so instead of failing to start.
    result = nanolab("generate", "hello", "--model", "tiny", "--max-tokens", "3", without="pandas")
    assert result.returncode == 0, result.stderr
    assert_refused(nanolab("bench", "--model", "tiny", without="pandas"), "needs the lab extra",
                   "pip install 'nanolab[lab]'")


class FakeLLM:
    """Stands in for LLM in-process: streams one delta, then raises `error`."""

    error: BaseException

    @classmethod
    def from_config(cls, config):
        return cls()

    def stream(self, prompt, params):
        yield "partial"
        raise self.error

    def close(self) -> None:  # `generate` ends a tensor-parallel group's workers whatever happened
        self.closed = True


@pytest.mark.parametrize("error,code,line", [(KeyboardInterrupt(), 130, None),
                                             (RuntimeError("the forward failed:\nboom"), 1,
                                              "error: the forward failed: boom")])
def test_generate_ends_cleanly_when_the_run_stops(monkeypatch, capsys, error, code, line) -> None:
    monkeypatch.setattr(FakeLLM, "error", error, raising=False)
    monkeypatch.setattr("nanolab.llm.LLM", FakeLLM)
    assert cli.main(["generate", "hello"]) == code
    out, err = capsys.readouterr()
    assert out == "partial\n"  # the half-written line is ended
    assert error_lines(err) == ([line] if line else []) and "Traceback" not in err


@pytest.mark.parametrize("args,needle", [(["--device", "cuda"], "device"), (["--port", "99999"], "--port"),
                                         (["--max-num-seqs", "0"], "max_num_seqs"),
                                         (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
                                         (["--step-log", "/no/such/folder/steps.jsonl"], "--step-log"),
                                         (["--model", "no-such-preset"], "no-such-preset"),
                                         (["--host", "no-such-host.invalid"], "--host no-such-host.invalid")])
def test_serve_refuses_bad_input_in_one_line(args: list[str], needle: str) -> None:
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_refused(nanolab("serve", "--model", "tiny", *args), needle)


def test_serve_never_writes_its_step_log_over_a_file(tmp_path) -> None:
    """A step log that names a file already there (or a folder) is refused before anything starts,
    and the file is left as it was."""
    kept = tmp_path / "kept.txt"
    kept.write_text("do not lose me")
    for path in (kept, tmp_path):
        result = nanolab("serve", "--model", "tiny", "--step-log", str(path))
        assert_refused(result, "--step-log", "must name a new file")
    assert kept.read_text() == "do not lose me"


def test_serve_refuses_a_port_in_use_before_preparing_weights(tmp_path, monkeypatch) -> None:
    # An empty cache: a preset's first use converts or synthesizes its weights, minutes for a large
    # one, and a taken port must be refused before that starts.
    monkeypatch.setenv("NANOLAB_CACHE", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = nanolab("serve", "--model", "tiny", "--port", port)
    assert_refused(result, f"--port {port}", "cannot bind")
    assert "engine built" not in result.stderr, result.stderr
    assert not any(tmp_path.iterdir()), "weights were prepared before the port was refused"


def test_serve_binds_every_address_its_host_names() -> None:
    from nanolab.entrypoints.openai.api_server import bind_sockets

    for host, expected in (("127.0.0.1", {"127.0.0.1"}), ("", {"0.0.0.0", "::"})):  # "": every interface
        sockets = bind_sockets(host, 0)
        try:
            assert {s.getsockname()[0] for s in sockets} <= expected and sockets
            assert "0.0.0.0" in {s.getsockname()[0] for s in sockets} or host
        finally:
            for s in sockets:
                s.close()


def test_serve_takes_the_step_budget() -> None:
    import argparse

    from nanolab.entrypoints.openai.api_server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = parser.parse_args([])
    assert default.enable_chunked_prefill is True and default.max_num_batched_tokens == 512
    assert default.cudagraph_mode == "full"
    off = parser.parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"])
    assert off.enable_chunked_prefill is False and off.max_num_batched_tokens == 2048
    assert not hasattr(default, "compile_varlen")


def test_graphbench_refuses_a_device_in_one_line() -> None:
    assert_refused(nanolab("graphbench", "--device", "tpu"), "device")


@pytest.mark.parametrize("argv,needle", [
    (["graphbench", "--rates", "0"], "--rates"), (["graphbench", "--max-rate", "inf"], "--max-rate"),
    (["graphbench", "--duration", "0"], "--duration"), (["graphbench", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["bench", "--batches", "0"], "--batches"),
    (["bench", "--steps", "0"], "--steps"), (["specbench", "--parts", "batches", "--batches", "x"], "--batches"),
    (["specbench", "--lookups", "4:9"], "--lookups")])
def test_bench_flags_are_checked_before_anything_runs(capsys, argv: list[str], needle: str) -> None:
    """Rates, sizes and times that would loop, divide by zero or lose requests: one error line naming
    the flag, before a model is loaded or a server started."""
    assert_refused_in_process(capsys, [*argv, "--model", "tiny", "--device", "cpu"], needle)


@pytest.mark.parametrize("text,needle", [("1,,2", "an empty entry"), ("1,1", "names a value twice"),
                                         ("", "holds no value"), ("1,x", "'x' is not an integer"),
                                         ("0", "must be at least 1")])
def test_bench_lists_refuse_what_they_would_drop_or_repeat(text: str, needle: str) -> None:
    from nanolab.lab.cliargs import float_list, int_list

    with pytest.raises(ValueError, match=f"^--batches: .*{needle}"):
        int_list(text, "--batches")
    if needle != "'x' is not an integer" and text != "0":
        with pytest.raises(ValueError, match=f"^--rates: .*{needle}"):
            float_list(text, "--rates")
    with pytest.raises(ValueError, match="^--rates: 'nan' must be a finite number above 0"):
        float_list("1,nan", "--rates")


@pytest.mark.parametrize("argv,needle", [
    (["specbench", "--parts", "latency,batches", "--batches", "x"], "--batches: 'x' is not an integer"),
    (["specbench", "--sets", "bogus"], "--sets 'bogus'"),
    (["fp8bench", "--parts", "steps,tiles", "--model", "tiny"], "--parts tiles runs on CUDA only"),
    (["graphbench", "--seed", "-1"], "--seed: -1 must be at least 0"),
    (["graphbench", "--arms", "eager,eager"], "--arms: 'eager,eager' names an arm twice"),
    (["prefixbench", "--parts", "hitrate", "--hit-rate", "inf"], "--hit-rate: inf must be a finite number"),
], ids=["specbench batches", "specbench sets", "fp8bench cuda part", "graphbench seed", "graphbench arms",
        "prefixbench rate"])
def test_benches_refuse_every_part_s_flags_before_any_part_runs(capsys, monkeypatch, tmp_path, argv, needle):
    """A bench refuses a bad value for any of its parts before the first part runs: nothing is
    measured, and no table is written."""
    import importlib

    bench = importlib.import_module(f"nanolab.lab.{argv[0]}")
    if hasattr(bench, "save_table"):
        monkeypatch.setattr(bench, "save_table", lambda *a, **k: pytest.fail("a table was written before the refusal"))
    if torch.cuda.is_available() and argv[0] == "fp8bench":
        pytest.skip("this machine has CUDA")
    assert_refused_in_process(capsys, argv, needle)


def test_a_table_name_holds_no_folder() -> None:
    """A bench's --prefix names tables in data/; one that holds a folder is refused, never written outside."""
    from nanolab.lab.report import figure_path, table_path

    for stem in ("../../tmp/x", "a/b", "", ".hidden"):
        with pytest.raises(ValueError, match="a plain file name"):
            table_path(stem, "cpu")
        with pytest.raises(ValueError, match="a plain file name"):
            figure_path(stem, "cpu")


@pytest.mark.parametrize("argv,needle", [
    (["bench", "--model", "tiny", "--device", "cpu", "--steps", "5000", "--batches", "1", "--prompt-len", "100"],
     "--prompt-len 100 and --steps 5000"),
    (["bench", "--model", "tiny", "--device", "cpu", "--steps", "2000", "--batches", "1", "--prompt-len", "48"],
     "make rows of 2049 tokens"),  # a timed run asks for steps + 1 tokens
    (["prefixsteps", "--model", "tiny", "--device", "cpu", "--system-len", "99999"], "(--system-len, --suffixes)"),
])
def test_benches_refuse_rows_longer_than_the_context(capsys, argv, needle):
    assert_refused_in_process(capsys, argv, needle)

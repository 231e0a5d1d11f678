"""The command line as a vLLM user types it: the model positional (`pipeline serve MODEL`),
`--host`/`--port` for the HTTP API, a close match for a misspelt flag, sizes with units
wherever bytes are taken, and vLLM's --dtype names. Parsing in process; one real
`pipeline serve MODEL --port P` and one `pipeline run MODEL`.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, free_port, make_tiny_model

from pipeline.cli import build_parser, main
from pipeline.config import DEFAULT_MODEL
from pipeline.engine_args import config_from_args
from pipeline.gateway.serve_args import check_args


def parse(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


# ---- the model, positional or --model ----------------------------------------------------
@pytest.mark.parametrize("command", ["serve", "run"])
def test_model_positional_or_flag(command, tmp_path):
    assert config_from_args(parse(command, str(tmp_path))).model_config.model == str(tmp_path)
    assert config_from_args(parse(command, "--model", str(tmp_path))).model_config.model == str(tmp_path)
    both = parse(command, str(tmp_path), "--model", str(tmp_path))  # the same twice: fine
    assert config_from_args(both).model_config.model == str(tmp_path)
    assert config_from_args(parse(command)).model_config.model == DEFAULT_MODEL


def test_model_given_twice_and_different_names_both(tmp_path):
    with pytest.raises(ValueError, match=r"positional '/a'.*--model '/b'"):
        config_from_args(parse("serve", "/a", "--model", "/b"))


# ---- --host/--port: the HTTP API ---------------------------------------------------------
def test_host_and_port_are_the_http_address():
    a = check_args(parse("serve", "--port", "8123"))
    assert a.http == "127.0.0.1:8123" and a.listen is None  # the HTTP API alone, as vLLM
    assert check_args(parse("serve", "--host", "localhost")).http == "localhost:8000"
    assert check_args(parse("serve", "--host", "::1", "--port", "9")).http == "[::1]:9"
    assert check_args(parse("serve")).http is None  # neither: the ZMQ daemon as before
    with pytest.raises(ValueError, match="--http.*--host/--port"):
        check_args(parse("serve", "--http", "8001", "--port", "8002"))
    with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\]"):
        check_args(parse("serve", "--port", "70000"))


def test_host_beyond_loopback_keeps_the_bind_rule(monkeypatch):
    monkeypatch.delenv("PIPELINE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="beyond loopback and --api-key is not set"):
        check_args(parse("serve", "--host", "0.0.0.0", "--port", "8000"))
    assert check_args(parse("serve", "--host", "0.0.0.0", "--api-key", "k")).http == "0.0.0.0:8000"


# ---- a misspelt flag ---------------------------------------------------------------------
def test_misspelt_flag_gets_the_nearest(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tensor-paralel-size", "2", "--max-num-seqz=3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pipeline serve: error: unrecognized arguments")
    assert "--tensor-paralel-size (did you mean --tensor-parallel-size?)" in err
    assert "--max-num-seqz (did you mean --max-num-seqs?)" in err


def test_nothing_near_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


# ---- sizes and dtypes --------------------------------------------------------------------
def test_sizes_take_units():
    a = parse("serve", "--kv-cache-memory", "2GiB", "--kv-offload-dir", "/tmp/x",
              "--kv-offload-size", "1.5G", "--max-frame-bytes", "64MiB")
    cfg = config_from_args(a)
    assert cfg.cache_config.kv_cache_memory == 2 << 30
    assert cfg.cache_config.kv_offload_size == 1_500_000_000
    assert check_args(a).max_frame_bytes == 64 << 20


@pytest.mark.parametrize(("given", "means"), [("auto", "auto"), ("half", "float16"),
                                               ("float16", "float16"), ("bfloat16", "bfloat16"),
                                               ("float", "float32"), ("float32", "float32")])
def test_dtype_names(given, means):
    assert config_from_args(parse("run", "--dtype", given)).model_config.dtype == means


def test_dtype_unknown_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("run", "--dtype", "float64")
    assert "invalid choice: 'float64'" in capsys.readouterr().err


# ---- end to end ----------------------------------------------------------------------------
def test_run_takes_the_model_positional(model):
    flags = [f for f in ENGINE_FLAGS if f != "float32"]
    flags[flags.index("--dtype") + 1:flags.index("--dtype") + 1] = ["float"]
    p = subprocess.run([*PIPELINE, "run", str(model), *flags, "--max-tokens", "3"],
                       input='{"prompt": "hello"}\n', capture_output=True, text=True,
                       timeout=240, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    (answer,) = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert answer.get("error") is None and answer["finish_reason"] in ("length", "stop")


def test_serve_model_port_serves_the_openai_api(model):
    """`vllm serve M --port P`, as typed: the OpenAI API on 127.0.0.1:P, model named M."""
    port = free_port()
    p = subprocess.Popen([*PIPELINE, "serve", str(model), "--port", str(port), *ENGINE_FLAGS],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env=env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        models = None
        while models is None and time.monotonic() < deadline and p.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
                models = r.json()
            except httpx.TransportError:
                time.sleep(0.2)
        assert models is not None, p.poll()
        assert [m["id"] for m in models["data"]] == [str(model)]
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert p.returncode == 0, out

"""The one bind rule: nothing listens beyond loopback without CURVE keys unless told to
(frontend.args.check_bind), enforced for `pipeline serve` and `pipeline router` --listen, and
the --curve-keys directory checked whole before anything starts (EngineConfig.check)."""
from __future__ import annotations

import argparse

import pytest

from pipeline.bind import check_bind
from pipeline.config import CURVE_FILES, EngineConfig
from pipeline.gateway.serve_args import add_args as add_serve_args
from pipeline.gateway.serve_args import check_args as check_serve_args
from pipeline.ipc.curve import generate_keys
from pipeline.router.args import add_args as add_router_args
from pipeline.router.args import check_args as check_router_args


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:7",
                                      "ipc:///tmp/x.sock"])
def test_loopback_binds_need_no_keys(endpoint):
    check_bind("--listen", endpoint, "", False)


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:9",
                                      "tcp://[::]:7", "tcp://example.com:1"])
def test_open_binds_need_keys_or_the_explicit_flag(endpoint):
    with pytest.raises(ValueError, match="--listen .* beyond loopback .*--curve-keys"):
        check_bind("--listen", endpoint, "", False)
    check_bind("--listen", endpoint, "/etc/keys", False)
    check_bind("--listen", endpoint, "", True)


def _parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_serve_and_router_refuse_an_open_listen_without_keys():
    open_ = ["--listen", "tcp://0.0.0.0:5555"]
    with pytest.raises(ValueError, match="beyond loopback"):
        check_serve_args(_parse(add_serve_args, open_))
    assert check_serve_args(_parse(add_serve_args, [*open_, "--allow-insecure-network"])).listen == open_[1]
    router = ["--instance", "tcp://127.0.0.1:6000"]
    with pytest.raises(ValueError, match="beyond loopback"):
        check_router_args(_parse(add_router_args, [*open_, *router]))
    args = check_router_args(_parse(add_router_args, [*open_, *router, "--allow-insecure-network"]))
    assert args.allow_insecure_network


def test_the_keys_directory_is_checked_whole(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    EngineConfig(curve_keys=str(keys)).check()
    for f in CURVE_FILES:
        (keys / f).rename(keys / (f + ".moved"))
        with pytest.raises(ValueError, match=f"--curve-keys {keys}: missing {f}"):
            EngineConfig(curve_keys=str(keys)).check()
        (keys / (f + ".moved")).rename(keys / f)


@pytest.mark.parametrize("flags, says", [
    (["--http", "0.0.0.0:8000"], "--http 0.0.0.0:8000 is beyond loopback and --api-key"),
    (["--metrics-port", "9100", "--metrics-host", "0.0.0.0"], "--metrics-host 0.0.0.0 is beyond loopback"),
    (["--metrics-port", "9100", "--metrics-host", "::"], "--metrics-host :: is beyond loopback"),
])
def test_the_http_ports_beyond_loopback_need_a_key_or_the_explicit_flag(flags, says, monkeypatch):
    monkeypatch.delenv("PIPELINE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=says):
        check_serve_args(_parse(add_serve_args, flags))
    check_serve_args(_parse(add_serve_args, [*flags, "--allow-insecure-network"]))
    for loopback in (["--http", "127.0.0.1:8000"], ["--metrics-port", "9100", "--metrics-host", "::1"]):
        check_serve_args(_parse(add_serve_args, loopback))

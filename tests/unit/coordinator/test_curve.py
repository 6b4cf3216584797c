"""CURVE on the coordinator's ROUTER: only allowlisted client keys get through.

The service runs in a thread with CURVE on; the test plays clients with DEALER sockets.
Nothing is synchronised with sleeps: a refused client is observed through its own
socket monitor (the handshake-failure event), and the service is then shown to keep
serving by an allowlisted client's hello being answered.
"""

import logging

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from flodl.curve import client_keys, keygen
from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator import cli
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import SettingsError, load_settings

SESSION = "curve-test"
WAIT_MS = 10_000  # an upper bound for a deadline, never a synchronising sleep


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_pub, server_sec = keygen(str(d), "coordinator")
    good_pub, good_sec = keygen(str(d), "good")
    _bad_pub, bad_sec = keygen(str(d), "stranger")
    (allowed / "good.key").write_bytes(open(good_pub, "rb").read())
    return {"server_pub": server_pub, "server_sec": server_sec, "allowed": str(allowed),
            "good_sec": good_sec, "bad_sec": bad_sec}  # fmt: skip


def _settings(keys, **extra):
    return load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://0.0.0.0:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0, "curve_secret_key": keys["server_sec"], "curve_allowed_keys": keys["allowed"],
        **extra,
    })  # fmt: skip


@pytest.fixture
def service(serve, keys, caplog):
    caplog.set_level(logging.INFO, logger="flodl.coordinator")
    svc, ep, ctx = serve(_settings(keys))
    return svc, ep.replace("0.0.0.0", "127.0.0.1"), ctx  # bound on every interface, dialed on loopback


class Client:
    def __init__(self, ctx, ep, rank, curve=None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
        )  # fmt: skip
        self.sock.connect(ep)
        self.me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=rank + 1)
        self.rank = rank

    def send_hello(self):
        msg = pb.RankHello(rank=self.rank, world_size=2, model_sig=b"a" * 32, dataset_len=100)
        self.sock.send_multipart(self.me.frames("hello", msg))

    def hello_ack(self):
        while True:
            assert self.sock.poll(WAIT_MS), "no hello_ack came back"
            m = decode(split_routing(self.sock.recv_multipart())[1], session=SESSION)
            if m.kind == "hello_ack":
                return m.envelope.hello_ack

    def refused(self) -> int:
        """Block until the handshake fails or the peer drops us; return the event."""
        assert self.monitor.poll(WAIT_MS), "the handshake neither failed nor was dropped"
        ev = recv_monitor_message(self.monitor)["event"]
        assert ev != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a client that should be refused got in"
        return ev


def test_only_allowlisted_keys_join_and_the_service_keeps_serving(service, keys, caplog):
    svc, ep, ctx = service
    stranger = Client(ctx, ep, 1, client_keys(keys["server_pub"], keys["bad_sec"]))
    plaintext = Client(ctx, ep, 1)
    stranger.send_hello()
    plaintext.send_hello()
    assert stranger.refused() == zmq.EVENT_HANDSHAKE_FAILED_AUTH  # ZAP said 400
    plaintext.refused()  # NULL mechanism against a CURVE server: dropped at the handshake
    again = Client(ctx, ep, 1, client_keys(keys["server_pub"], keys["bad_sec"]))  # the same key, again
    again.send_hello()
    assert again.refused() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    denials = [r for r in caplog.records if "not in curve_allowed_keys" in r.getMessage()]
    assert len(denials) == 1, "... but logged once per key"

    good = Client(ctx, ep, 0, client_keys(keys["server_pub"], keys["good_sec"]))
    good.send_hello()
    assert good.hello_ack().accepted
    # Nothing from the refused clients ever reached the loop: no drops, rank 1 not admitted.
    assert dict(svc.dropped) == {}
    assert svc.state.route_of(1) is None
    assert not any(c.sock.poll(0) for c in (stranger, again, plaintext))
    # CURVE on: a non-loopback bind does not print the insecure-bind warning.
    started = caplog.get_records("setup")
    assert not [r for r in started if "SECURITY" in r.getMessage()]
    assert any("CURVE on: 1 allowed client key(s)" in r.getMessage() for r in started)


def test_without_keys_a_non_loopback_bind_still_warns(caplog):
    caplog.set_level(logging.WARNING, logger="flodl.coordinator")
    svc = CoordinatorService(load_settings(env={}, flags={"world_size": 1, "bind": "tcp://0.0.0.0:0"}))
    assert svc.curve_keys is None
    svc._warn_if_insecure()
    assert any("SECURITY" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"curve_allowed_keys": ""}, "CURVE needs both curve_secret_key and curve_allowed_keys; curve_allowed_keys"),
        ({"curve_secret_key": ""}, "CURVE needs both .* curve_secret_key is not set"),
        ({"curve_secret_key": "/nonexistent/c.key_secret"}, r"curve_secret_key /nonexistent/c.key_secret does not exist"),
        ("public-as-secret", "holds no secret key"),
        ({"curve_allowed_keys": "/nonexistent-dir"}, "curve_allowed_keys /nonexistent-dir is not a directory"),
        ("empty-allowlist", r"holds no public certificate \(\*\.key\)"),
        ("garbage-cert", "not a ZeroMQ certificate|malformed key"),
    ],
)
def test_curve_settings_errors_are_one_line(keys, tmp_path, change, message):
    if change == "public-as-secret":
        change = {"curve_secret_key": keys["server_pub"]}
    elif change == "empty-allowlist":
        (tmp_path / "empty").mkdir()
        change = {"curve_allowed_keys": str(tmp_path / "empty")}
    elif change == "garbage-cert":
        (tmp_path / "junk.key_secret").write_text("public-key = \"short\"\n")
        change = {"curve_secret_key": str(tmp_path / "junk.key_secret")}
    with pytest.raises(SettingsError, match=message) as e:
        _settings(keys, **change)
    assert "\n" not in str(e.value)


def test_cli_exits_2_on_a_bad_key_and_keygen_writes_a_pair(keys, tmp_path, capsys):
    rc = cli.main(["serve", "--world-size", "1", "--curve-secret-key", keys["server_pub"],
                   "--curve-allowed-keys", keys["allowed"]])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flodl-coordinator: config error:") and "holds no secret key" in err
    assert "\n" not in err
    assert cli.main(["keygen", str(tmp_path / "k"), "n1"]) == 0
    assert (tmp_path / "k" / "n1.key").exists() and (tmp_path / "k" / "n1.key_secret").stat().st_mode & 0o077 == 0
    assert cli.main(["keygen", str(tmp_path / "k"), "n1"]) == 2  # never overwrites a key

"""The transport registry (ecd/transport/registry.py): transports by name, imported only when
made; config validation asks it which names `[cluster] transport` accepts."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ecd.config import ConfigError, load_config
from ecd.transport import Transport, TransportUnavailable
from ecd.transport.registry import TransportRegistry, UnknownTransport, transport_class, transport_names
from ecd.transport.tcp import TcpTransport

FAKE_MODULE = "ecd_test_fake_transport"


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """A transport module on sys.path that nobody has imported yet."""
    (tmp_path / f"{FAKE_MODULE}.py").write_text(textwrap.dedent('''
        from ecd.transport.base import GrantTable, Transport

        class FakeTransport(Transport):
            name = "fake"
            has_data_listener = False

            def __init__(self, host, port, **kwargs):
                self.address, self.kwargs, self.grants, self.executor = (host, port), kwargs, GrantTable(), None

            def bind(self):
                return self.address

            def serve(self, segments, on_sent):
                return self.address

            def pull(self, host, port, items, deadline):
                return 0

            def close(self):
                pass

        NotATransport = object
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, FAKE_MODULE, raising=False)
    yield FAKE_MODULE
    sys.modules.pop(FAKE_MODULE, None)


def test_a_registered_transport_is_imported_only_when_made(fake_module):
    registry = TransportRegistry()
    registry.register("fake", fake_module, "FakeTransport")
    assert registry.names() == ("fake",) and "fake" in registry
    assert fake_module not in sys.modules  # registering (and listing the names) imports nothing
    transport = registry.make("fake", host="h", port=7, max_inflight=2, instance="ecd:n:1")
    assert fake_module in sys.modules
    assert isinstance(transport, Transport) and transport.name == "fake"
    assert transport.bind() == ("h", 7) and transport.kwargs == {"max_inflight": 2, "instance": "ecd:n:1"}
    assert registry.transport_class("fake") is type(transport)


def test_an_unknown_name_is_refused_with_the_registered_names():
    registry = TransportRegistry()
    registry.register("tcp", "ecd.transport.tcp", "TcpTransport")
    registry.register("rdma", "nowhere.rdma", "RdmaTransport")
    with pytest.raises(UnknownTransport, match=r"""unknown transport 'udp': "tcp" or "rdma\"""") as info:
        registry.make("udp", host="h", port=1)
    assert isinstance(info.value, ValueError)


def test_a_name_is_registered_once():
    registry = TransportRegistry()
    registry.register("tcp", "ecd.transport.tcp", "TcpTransport")
    with pytest.raises(ValueError, match="'tcp' is already registered"):
        registry.register("tcp", "elsewhere", "OtherTransport")
    assert registry.transport_class("tcp") is TcpTransport  # the first registration stands


def test_a_module_or_class_that_does_not_load_is_unavailable(fake_module):
    registry = TransportRegistry()
    registry.register("missing", "ecd_test_no_such_module", "X")
    registry.register("wrong", fake_module, "NotATransport")
    registry.register("absent", fake_module, "NoSuchClass")
    for name in ("missing", "wrong", "absent"):
        with pytest.raises(TransportUnavailable):
            registry.transport_class(name)


def test_the_daemon_registers_tcp_first_and_nixl():
    assert transport_names()[:2] == ("tcp", "nixl")
    assert transport_class("tcp") is TcpTransport
    assert transport_class("tcp").has_data_listener and transport_class("tcp").owner_sees_send


def test_config_refuses_an_unknown_transport_listing_the_registered_names():
    with pytest.raises(ConfigError) as info:
        load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "transport": "udp"}})
    assert str(info.value).startswith('cluster.transport: must be "tcp" or "nixl"'), info.value
    assert "'udp'" in str(info.value)


def test_config_asks_the_transport_for_its_own_checks():
    with pytest.raises(ConfigError, match=r'cluster.tls: applies to transport "tcp" only'):
        load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "transport": "nixl", "tls": True}})
    # nixl has no data listener of its own: data_listen need not be on listen's host
    cluster = load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "transport": "nixl",
                                       "data_listen": "tcp://127.0.0.2:7481", "insecure": True}}).cluster
    assert cluster.transport == "nixl"
    with pytest.raises(ConfigError, match="cluster.data_listen: must be on listen's host"):
        load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "data_listen": "tcp://127.0.0.2:7481",
                                 "insecure": True}})


def test_config_and_the_names_do_not_import_a_transport_module_not_chosen():
    """A fresh interpreter: loading a tcp config imports neither nixl's module nor NIXL."""
    code = textwrap.dedent('''
        import sys
        from ecd.config import load_config
        from ecd.transport.registry import transport_names
        load_config({"cluster": {"listen": "tcp://127.0.0.1:7480", "insecure": True}})
        assert "nixl" in transport_names()
        loaded = [m for m in sys.modules if m == "ecd.transport.nixl" or m.split(".")[0].startswith("nixl")]
        assert not loaded, loaded
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

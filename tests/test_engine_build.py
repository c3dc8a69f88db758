"""``workbench.engine.build``: an engine start that lost the race for its distributed-init port starts again."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from workbench import engine  # noqa: E402


class DistNetworkError(RuntimeError):  # torch.distributed's, by name
    pass


RACE = ("The server socket has failed to listen on any local network address. port: 39681, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use")


def _fake_llm(monkeypatch, failures):
    calls = []

    class FakeLLM:
        def __init__(self, **kw):
            calls.append(kw)
            if failures:
                raise failures.pop(0)

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(engine, "free", lambda llm: calls.append("freed"))
    return calls


def test_a_lost_port_race_starts_the_engine_again(monkeypatch, capsys):
    calls = _fake_llm(monkeypatch, [DistNetworkError(RACE)])
    llm, start_s = engine.build({"model": "m"})
    assert calls == [{"model": "m"}, "freed", {"model": "m"}] and start_s >= 0
    assert "lost its distributed-init port" in capsys.readouterr().err


def test_other_errors_and_a_race_lost_every_time_are_raised(monkeypatch):
    calls = _fake_llm(monkeypatch, [ValueError("bad model")])
    with pytest.raises(ValueError, match="bad model"):
        engine.build({"model": "m"})
    assert calls == [{"model": "m"}]
    _fake_llm(monkeypatch, [DistNetworkError(RACE) for _ in range(engine.PORT_RACE_RETRIES + 1)])
    with pytest.raises(DistNetworkError):
        engine.build({"model": "m"})
    assert not engine.port_race(OSError("EADDRINUSE"))  # a server's own port is not this race

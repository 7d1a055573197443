"""Which failures a site waits out: a shard that went away (UNAVAILABLE, or a stream it reset as it
stopped, which the client sees as CANCELLED) is waited for; anything else is raised at once."""

from __future__ import annotations

import grpc
import pytest

from dilocox.worker.exchange.shard_wait import AggregatorError, call_waiting


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name} from a test"


class _Connected:
    """A channel that reports itself connected at once (what `channel_ready_future` watches)."""

    def subscribe(self, callback, try_to_connect=False):  # noqa: ANN001 - grpc.Channel protocol
        callback(grpc.ChannelConnectivity.READY)

    def unsubscribe(self, callback):  # noqa: ANN001
        pass


def _failing(*codes: grpc.StatusCode):
    calls = []

    def fn() -> str:
        calls.append(len(calls))
        if len(calls) <= len(codes):
            raise _Refused(codes[len(calls) - 1])
        return "answered"

    return fn, calls


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_shard_that_went_away_is_waited_for(code):
    fn, calls = _failing(code, code)
    reconnected = []
    assert call_waiting(fn, "shard:1", _Connected(), 30, on_reconnect=lambda: reconnected.append(1)) == "answered"
    assert len(calls) == 3 and len(reconnected) == 2


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL]
)
def test_other_failures_are_raised_at_once(code):
    fn, calls = _failing(code)
    with pytest.raises(AggregatorError) as raised:
        call_waiting(fn, "shard:1", _Connected(), 30)
    assert raised.value.code == code and len(calls) == 1


def test_without_a_wait_one_try():
    fn, calls = _failing(grpc.StatusCode.CANCELLED)
    with pytest.raises(AggregatorError) as raised:
        call_waiting(fn, "shard:1", _Connected(), 0)
    assert raised.value.code == grpc.StatusCode.CANCELLED and len(calls) == 1


def test_a_first_contact_with_a_mistyped_host_says_so_while_it_waits():
    """A wrong address used to be silent for the whole connect timeout (60 s): now a warning names it every
    few seconds, with the time left, before the join gives up."""
    from structlog.testing import capture_logs

    from dilocox.worker.exchange.aggregator_client import AggregatorClient
    from dilocox.worker.exchange.shard_wait import FIRST_CONTACT_SAY_EVERY_S

    with (
        capture_logs() as logs,
        AggregatorClient(
            ["nosuchhost.invalid:50051"], "run", "c", connect_timeout=FIRST_CONTACT_SAY_EVERY_S + 3, shard_wait_s=0
        ) as client,
    ):
        with pytest.raises(AggregatorError):
            client.join([("w", (2, 2))])
    said = [e for e in logs if e["event"] == "shard_not_reached_yet"]
    assert said and said[0]["address"] == "nosuchhost.invalid:50051" and said[0]["gives_up_in_s"] >= 0


def test_inside_an_exchange_no_call_waits_past_its_end():
    """A rank's exchange ends within shard wait + pull wait whatever fails when: the communicator sets the
    client's `outage_deadline`, and every wait for an unreachable shard stops there (a real gRPC channel to
    a port nothing listens on: with a 30 s shard wait, the call gives up at the 1.5 s deadline), so a rank's
    exchange stays inside the site's agreement timeout (common/config/waits.collective_timeout_for)."""
    import time

    from dilocox.common.config.waits import MARGIN_S, PULL_WAIT_S, RPC_TIMEOUT_S, SHARD_WAIT_S, collective_timeout_for
    from dilocox.proto import dilocox_pb2 as pb
    from dilocox.worker.exchange.aggregator_client import AggregatorClient
    from tests.ports import free_port

    with AggregatorClient([f"127.0.0.1:{free_port()}"], "run", "c", connect_timeout=1, shard_wait_s=30) as client:
        address, stub = client.addresses[0], client._stubs_by_address[0]
        client.outage_deadline = time.monotonic() + 1.5
        started = time.monotonic()
        with pytest.raises(AggregatorError) as raised:
            client._call(address, lambda: stub.Status(pb.StatusRequest(), timeout=1), call="status")
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5  # not the 30 s shard wait
    assert collective_timeout_for(SHARD_WAIT_S, PULL_WAIT_S) == SHARD_WAIT_S + PULL_WAIT_S + RPC_TIMEOUT_S + MARGIN_S

"""``--events zmq://HOST:PORT`` and ``--events-format``: bad values are refused in one line
with exit status 2, before the model loads when they can be; an IPv6 address binds; the
summary line counts what went out."""

import re
import socket
from pathlib import Path

import msgspec
import pytest
import zmq

from harness.cli.events_target import (
    ZmqTarget,
    close_event_stream,
    open_event_stream,
    parse_events_target,
)
from harness.cli.main import main
from harness.kv_publisher import KVEventStream
from spec.event_stream import KeyRemoved
from tests.events.loopback import SlowWire, free_port_pair, open_wire, receive, wait_for
from tests.support.harness_cases import save_model_directory, tiny_model


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line on stderr (progress lines aside), with no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize(
    "target", ["zmq://127.0.0.1", "zmq://:5557", "zmq://127.0.0.1:65535", "zmq://h:0", "zmq://h:x"]
)
def test_a_zmq_target_without_a_host_and_a_usable_port_is_bad_input(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(["--device", "cpu", "--events", target])
    assert exit_status.value.code == 2
    assert f"{target!r} is not zmq://HOST:PORT with PORT in 1..65534" in one_error_line(capsys)


@pytest.mark.parametrize("events", [[], ["--events", "out.jsonl"]])
def test_a_wire_format_needs_a_zmq_target(
    events: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--device", "cpu", *events, "--events-format", "vllm-array"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(argv) == 2
    assert one_error_line(capsys).endswith(
        "--events-format vllm-array needs --events zmq://HOST:PORT"
    )


def test_an_address_in_use_is_refused_in_one_line_once_the_model_is_loaded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model_dir = save_model_directory(tiny_model().model, tmp_path / "tiny")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--device", "cpu", "--model", str(model_dir), "--events", f"zmq://127.0.0.1:{port}"]
        assert main(argv) == 2
    assert f"--events zmq://127.0.0.1:{port}: cannot bind" in one_error_line(capsys)


def test_a_run_refused_after_binding_unbinds_its_address(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("harness.cli.events_target.SUBSCRIBER_WAIT_S", 0)
    model_dir = save_model_directory(tiny_model().model, tmp_path / "tiny")
    port = free_port_pair()
    argv = ["--device", "cpu", "--model", str(model_dir), "--total-blocks", "1"]
    assert main([*argv, "--events", f"zmq://127.0.0.1:{port}"]) == 2
    assert "--total-blocks" in one_error_line(capsys)
    # ZeroMQ closes a socket in its I/O thread: give it a moment, then both ports bind.
    wait_for(lambda: all(is_free(p) for p in (port, port + 1)), bool, "the ports to be free")


def is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Issue 49: a forgotten scheme wrote a file named like the address.
@pytest.mark.parametrize(
    ("target", "message"),
    [
        *(
            (address, f"{address!r} is an address, not a file: write zmq://{address} to publish")
            for address in ("127.0.0.1:5557", "localhost:5557", "[::1]:5557")
        ),
        ("tcp://127.0.0.1:5557", "'tcp://127.0.0.1:5557': the one scheme is zmq://HOST:PORT"),
        ("zmq://::1:5557", "'zmq://::1:5557': an IPv6 address goes in brackets, zmq://[::1]:5557"),
    ],
)
def test_an_address_that_is_not_zmq_host_port_is_refused_not_written_as_a_file(
    target: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    absent = str(tmp_path / "absent")  # taken for a file, the run would stop at the model
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_status:
        patch.chdir(tmp_path)
        main(["--device", "cpu", "--model", absent, "--events", target])
    assert exit_status.value.code == 2
    assert message in one_error_line(capsys)


def has_ipv6_loopback() -> bool:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_target_binds_and_a_subscriber_on_ipv6_loopback_receives_the_stream() -> None:
    """Issue 49: ``zmq://[::1]:P`` failed with "No such device" (IPv6 off on the socket)."""
    port = free_port_pair("::1")
    target = parse_events_target(f"zmq://[::1]:{port}")
    assert target == ZmqTarget("[::1]", port)
    subscriber: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.IPV6, 1)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://[::1]:{port}")
    try:
        stream = open_event_stream(target, None, 4, (None,))
        (frames,) = receive(subscriber, 1)
        summary = close_event_stream(stream, target)
    finally:
        subscriber.close(linger=0)
    assert msgspec.msgpack.decode(frames[2])[1] == [{"type": "AllBlocksCleared"}]
    assert summary == f"published 1 KV cache events in 1 batches at zmq://[::1]:{port}"


def test_the_summary_says_how_many_batches_closing_dropped() -> None:
    with open_wire(SlowWire) as wire:
        stream = KVEventStream(wire.publisher)  # the opening clear, then 50 more
        for n in range(50):
            wire.publisher.publish((KeyRemoved(0, "GPU", n),))
        summary = close_event_stream(stream, ZmqTarget("127.0.0.1", wire.port), timeout_s=0.1)
    sent = wire.publisher.sent_batches
    assert summary == (
        f"published {sent} KV cache events in {sent} batches at zmq://127.0.0.1:{wire.port}; "
        f"{51 - sent} batches not sent within 0.1 s"
    )
    assert 51 - sent > 0


def test_the_summary_counts_every_event_a_subscriber_received(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 49: it counted the device events alone, not the opening clear nor the host
    prefix cache's (medium CPU)."""
    model_dir = save_model_directory(tiny_model().model, tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{p}"}}\n' for p in ("q r s", "t u v w", "x y z")))
    port = free_port_pair()
    subscriber: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    argv = [
        *("--device", "cpu", "--model", str(model_dir), "--prompts-file", str(prompts)),
        *("--system-prompt", "a b c d e f g h i j k l m n o p", "--max-new-tokens", "6"),
        *("--block-size", "4", "--total-blocks", "12", "--host-blocks", "16"),
        *("--threads", "1", "--events", f"zmq://127.0.0.1:{port}"),
    ]
    try:
        assert main(argv) == 0
        line = next(x for x in capsys.readouterr().err.splitlines() if "published" in x)
        summary = re.search(r"published (\d+) KV cache events in (\d+) batches at", line)
        assert summary is not None, line
        events_claimed, batches = int(summary[1]), int(summary[2])
        received = receive(subscriber, batches)
        assert not subscriber.poll(200)  # and no more
    finally:
        subscriber.close(linger=0)
    events = [event for frames in received for event in msgspec.msgpack.decode(frames[2])[1]]
    assert len(events) == events_claimed
    assert events[0] == {"type": "AllBlocksCleared"}
    assert {event.get("medium") for event in events} == {None, "GPU", "CPU"}

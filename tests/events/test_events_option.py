"""``--events zmq://HOST:PORT`` and ``--events-format``: bad values are refused in one line
with exit status 2, before the model loads when they can be."""

import socket
from pathlib import Path

import pytest

from harness.cli.main import main
from tests.events.loopback import free_port_pair, wait_for
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

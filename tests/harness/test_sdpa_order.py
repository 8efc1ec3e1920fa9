"""``harness_sdpa_order``: on CUDA FlashAttention first and cuDNN's attention off, in every
block of a process; nothing changed on CPU.

torch 2.11 on an H200 put cuDNN first for bfloat16 (2026-12-04), where a call at a new key
count cost 37 ms against FlashAttention's 0.07 ms, and it installs that order on a process's
first SDPA dispatch, over an order set before. The tests start from that order (set by
hand: this machine's torch starts from flash) and read torch's flags and priority list,
which need no device.
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.runtime.sdpa_order import HARNESS_ORDER, describe_order, harness_sdpa_order

HOPPER_DEFAULT = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
CUDA = torch.device("cuda")


def _order() -> list[int]:
    """torch's SDPA priority list, as backend numbers."""
    return list(torch._C._get_sdp_priority_order())


def _enabled() -> list[int]:
    """The enabled backends in torch's priority order: the ones a call can get, best first."""
    flags = {
        int(SDPBackend.FLASH_ATTENTION.value): torch._C._get_flash_sdp_enabled(),
        int(SDPBackend.EFFICIENT_ATTENTION.value): torch._C._get_mem_efficient_sdp_enabled(),
        int(SDPBackend.MATH.value): torch._C._get_math_sdp_enabled(),
        int(SDPBackend.CUDNN_ATTENTION.value): torch._C._get_cudnn_sdp_enabled(),
    }
    return [backend for backend in _order() if flags.get(backend, False)]


def _numbers(backends: list[SDPBackend] | tuple[SDPBackend, ...]) -> list[int]:
    return [int(backend.value) for backend in backends]


def test_on_cuda_flash_comes_first_cudnn_is_off_and_both_come_back_after() -> None:
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True):
        before = _enabled()
        with harness_sdpa_order(CUDA):
            assert _enabled() == _numbers(HARNESS_ORDER)
        assert _enabled() == before == _numbers(HOPPER_DEFAULT)


def test_cudnn_stays_off_when_torch_puts_it_first_inside_the_block() -> None:
    # What torch does on a process's first SDPA dispatch on Hopper: the cuDNN-first order
    # over whatever was set. A priority alone would hand cuDNN the next call.
    with harness_sdpa_order(CUDA):
        torch._C._set_sdp_priority_order(_numbers([*HOPPER_DEFAULT, SDPBackend.OVERRIDEABLE]))
        assert _enabled() == _numbers(HARNESS_ORDER)


def test_a_second_block_picks_as_the_first_did() -> None:
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True):
        picks = []
        for _ in range(2):
            with harness_sdpa_order(CUDA):
                picks.append(_enabled())
        assert picks == [_numbers(HARNESS_ORDER)] * 2


def test_on_cpu_nothing_changes() -> None:
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True), harness_sdpa_order(torch.device("cpu")):
        assert _enabled() == _numbers(HOPPER_DEFAULT)


def test_the_order_in_words() -> None:
    assert describe_order() == (
        "FLASH_ATTENTION > EFFICIENT_ATTENTION > MATH (CUDNN_ATTENTION off)"
    )

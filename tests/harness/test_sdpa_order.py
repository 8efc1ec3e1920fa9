"""``harness_sdpa_order``: cuDNN's attention last on CUDA, nothing changed on CPU.

torch 2.11 on an H200 put cuDNN first for bfloat16 (2026-12-04), where a call at a new key
count cost 37 ms against FlashAttention's 0.07 ms. The test starts from that order (set by
hand: this machine's torch starts from flash) and reads torch's priority list, which needs
no device.
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


def _order() -> list[int]:
    """torch's SDPA priority list, as backend numbers (the first four: ours are four)."""
    return list(torch._C._get_sdp_priority_order())[:4]


def _numbers(backends: list[SDPBackend] | tuple[SDPBackend, ...]) -> list[int]:
    return [int(backend.value) for backend in backends]


def test_on_cuda_cudnn_goes_last_and_the_order_comes_back_after() -> None:
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True):
        assert _order() == _numbers(HOPPER_DEFAULT)
        with harness_sdpa_order(torch.device("cuda")):
            assert _order() == _numbers(HARNESS_ORDER)
            assert HARNESS_ORDER[-1] == SDPBackend.CUDNN_ATTENTION
            assert torch._C._get_cudnn_sdp_enabled()  # last, not off
        assert _order() == _numbers(HOPPER_DEFAULT)


def test_on_cpu_nothing_changes() -> None:
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True), harness_sdpa_order(torch.device("cpu")):
        assert _order() == _numbers(HOPPER_DEFAULT)


def test_the_order_in_words() -> None:
    assert describe_order() == ("FLASH_ATTENTION > EFFICIENT_ATTENTION > MATH > CUDNN_ATTENTION")

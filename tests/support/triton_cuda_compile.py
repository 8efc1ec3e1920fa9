"""Compile the Triton paged-attention kernel for NVIDIA GPUs on a machine without one.

``python -m tests.support.triton_cuda_compile`` (in a process not in Triton's
interpreter) compiles ``harness.runtime.triton_paged``'s kernel with Triton's own compiler
for sm_80 (A100) and sm_90 (H100/H200) in float32, bfloat16 and float16, at SmolLM2's
shapes, and prints one line per build. The interpreter runs what the compiler would refuse
(a global in an annotation, for one), so CI runs this too: the GPU stage should never fail
on a typo. Exit 1 if a build fails.
"""

import sys
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from harness.runtime.triton_paged import BLOCK_N, paged_attention_kernel

TARGETS = (80, 90)
DTYPES = ("fp32", "bf16", "fp16")
POINTERS = ("out_ptr", "q_ptr", "k_ptr", "v_ptr")
INT_POINTERS = ("block_table_ptr", "seqused_k_ptr", "cu_seqlens_q_ptr")
INTS = (
    "q_tiles",
    "q_stride_t",
    "q_stride_h",
    "o_stride_t",
    "o_stride_h",
    "k_stride_block",
    "k_stride_row",
    "k_stride_head",
    "v_stride_block",
    "v_stride_row",
    "v_stride_head",
    "table_stride",
)


def build(
    dtype: str,
    capability: int,
    kernel: Any = paged_attention_kernel,  # Any: a Triton function (triton is untyped)
) -> int:
    """``kernel`` for ``dtype`` on ``sm_{capability}``; the size of its cubin in bytes."""
    constants: dict[str, object] = {
        # SmolLM2-135M: 9 query heads over 3 KV heads of 64; blocks of 16.
        "GROUP": 3,
        "GROUP_P": 4,
        "HEAD_DIM": 64,
        "HEAD_DIM_P": 64,
        "BLOCK_SIZE": 16,
        "BLOCK_Q": 4,
        "BLOCK_N": BLOCK_N,
        "PRECISION": "ieee" if dtype == "fp32" else None,
    }
    signature = {
        **{name: f"*{dtype}" for name in POINTERS},
        **{name: "*i32" for name in INT_POINTERS},
        "scale": "fp32",
        **{name: "i32" for name in INTS},
        **{name: "constexpr" for name in constants},
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    kernel = compile(source, target=GPUTarget("cuda", capability, 32))
    return len(kernel.asm["cubin"])


def main() -> int:
    """Every build, one line each; 1 if one failed."""
    failed = False
    for capability in TARGETS:
        for dtype in DTYPES:
            try:
                print(f"sm_{capability} {dtype}: {build(dtype, capability)} bytes of cubin")
            except Exception as error:  # a compile error, reported in its own words
                print(f"sm_{capability} {dtype}: FAILED {type(error).__name__}: {error}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

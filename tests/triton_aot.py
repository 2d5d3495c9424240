"""Compiles raygraph's Triton kernels for an H100/H200 (sm_90) without a GPU: the compiler's
front end and ptxas see every constexpr branch the interpreter runs as plain Python. Run in
a process without TRITON_INTERPRET (tests/test_triton_compile.py); prints one line a kernel.

Signatures follow the kernels' naming: `*_ptr` pointers (int32 for tables, lengths and
offsets, fp32 for split partials, bf16 otherwise), UPPERCASE constexprs, the rest int32
(scales fp32)."""

from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_PTRS = {"tables_ptr", "lens_ptr", "shared_ptr", "starts_ptr"}
FP32_PTRS = {"ml_ptr", "acc_ptr"}


def signature(fn: triton.JITFunction) -> dict[str, str]:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in FP32_PTRS else "*bf16"
        else:
            sig[name] = "fp32" if name.startswith("scale") else "i32"
    return sig


def compile_kernel(fn: triton.JITFunction, constexprs: dict, num_warps: int) -> None:
    params = inspect.signature(fn.fn).parameters
    missing = [p for p in params if p.isupper() and p not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {missing}")
    triton.compile(ASTSource(fn=fn, signature=signature(fn), constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def attention_cases() -> list[tuple[str, triton.JITFunction, dict, int]]:
    from raygraph.model import triton_attention as ta

    decode = dict(GROUP=4, GROUP_PAD=16, D=64, BS=16, TILE=64, SPLITS=16, NUM_HEADS=32,
                  STORE=True, WINDOW=0, PRECISION="tf32", STAGES=3, CASCADE=False, TOTAL=16)
    cascade = decode | dict(CASCADE=True, TOTAL=32)
    prefix = {k: cascade[k] for k in ("GROUP", "D", "BS", "TILE", "SPLITS", "TOTAL",
                                      "NUM_HEADS", "PRECISION", "STAGES")}
    prefix |= dict(PREFIX_SPLITS=8, ROWS=ta.PREFIX_ROWS)
    merge = {k: decode[k] for k in ("D", "SPLITS", "NUM_HEADS", "TILE", "WINDOW", "CASCADE",
                                    "TOTAL")} | dict(PREFIX_SPLITS=8)
    prefill = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, D=64, D_PAD=64, BS=16, BLOCK_N=64,
                   WINDOW=0, ZERO_BLOCKS=ta.ZERO_BLOCKS, PRECISION="tf32")
    return [
        ("decode split", ta._decode_split_kernel, decode, 2),
        ("decode split, window", ta._decode_split_kernel, decode | dict(WINDOW=37), 2),
        ("decode split, cascade", ta._decode_split_kernel, cascade, 2),
        ("decode prefix (cascade)", ta._decode_prefix_kernel, prefix, ta.PREFIX_WARPS),
        ("decode merge", ta._decode_merge_kernel, merge, 1),
        ("decode merge, cascade", ta._decode_merge_kernel,
         merge | dict(CASCADE=True, TOTAL=32), 1),
        ("prefill", ta._prefill_kernel, prefill, 4),
        ("prefill, head 80, window", ta._prefill_kernel,
         prefill | dict(D=80, D_PAD=128, WINDOW=37), 8),
    ]


def main() -> int:
    for name, fn, constexprs, warps in attention_cases():
        compile_kernel(fn, constexprs, warps)
        print(f"compiled {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

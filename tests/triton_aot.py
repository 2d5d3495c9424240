"""Compiles raygraph's Triton kernels for an H100/H200 (sm_90) without a GPU: the compiler's
front end and ptxas see every constexpr branch the interpreter runs as plain Python. Run in
a process without TRITON_INTERPRET (tests/test_triton_compile.py); prints one line a kernel.

Signatures follow the kernels' naming: `*_ptr` pointers (int32 for tables, lengths and
offsets, fp32 for split partials, bf16 otherwise, unless a case says), the rest int32
(scales and eps fp32)."""

from __future__ import annotations

import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT_PTRS = {"tables_ptr", "lens_ptr", "shared_ptr", "starts_ptr"}
FP32_PTRS = {"ml_ptr", "acc_ptr", "ws_ptr"}


Case = tuple[str, triton.JITFunction, dict, int, dict]  # name, kernel, constexprs, warps, types


def signature(fn: triton.JITFunction, types: dict[str, str] | None = None) -> dict[str, str]:
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in FP32_PTRS else "*bf16"
        else:
            sig[name] = "fp32" if name.startswith("scale") or name == "eps" else "i32"
    return sig | (types or {})


def aligned(sig: dict[str, str]) -> dict[tuple[int], list]:
    """What the JIT specializes on at llama-1b's shapes: pointers 16-byte aligned (torch's
    allocations and the head-aligned views) and strides multiples of 16. Without it loads
    are not vectorized and no load is pipelined through shared memory (cp.async), and the
    registers and spills reported are those of a kernel that never runs."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
            if kind.startswith("*") or name.startswith("stride")}


def compile_kernel(fn: triton.JITFunction, constexprs: dict, num_warps: int,
                   types: dict[str, str] | None = None, num_stages: int = 3):
    pdl = any(p.name == "PDL" for p in fn.params)
    if pdl:  # as a GPU launches them at one token (a case may say PDL=False: more rows)
        constexprs = {"PDL": True} | constexprs
        pdl = constexprs["PDL"]
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no value for {missing}")
    sig = signature(fn, types)
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                      attrs=aligned(sig)),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages,
                                     "launch_pdl": pdl})
    if pdl:
        check_pdl(fn.__name__, kernel)
    return kernel


def check_pdl(name: str, kernel) -> None:
    """A kernel launched with PDL lets the next one launch at its start, before it waits for
    its inputs (raygraph/model/triton_pdl.py): in its PTX the trigger precedes the wait."""
    ptx = kernel.asm["ptx"]
    trigger = ptx.find("griddepcontrol.launch_dependents")
    wait = ptx.find("griddepcontrol.wait")
    if not 0 <= trigger < wait:
        raise AssertionError(f"{name}: PDL trigger at {trigger}, wait at {wait} in its PTX")


def attention_cases() -> list[Case]:
    from raygraph.model import triton_attention as ta

    decode = dict(GROUP=4, GROUP_PAD=16, D=64, BS=16, TILE=64, SPLITS=16, NUM_HEADS=32,
                  STORE=True, WINDOW=0, PRECISION="tf32", STAGES=3, CASCADE=False, TOTAL=16,
                  PREFIX_SPLITS=0, ROPE=False, VERIFY=False, CHUNKS=False, CH=8, CR=32,
                  PEEL=True)
    cascade = decode | dict(CASCADE=True, TOTAL=32, PREFIX_SPLITS=8)
    prefix = {k: cascade[k] for k in ("GROUP", "D", "BS", "TILE", "SPLITS", "TOTAL",
                                      "NUM_HEADS", "PRECISION", "STAGES", "PREFIX_SPLITS",
                                      "ROPE")}
    prefix |= dict(ROWS=ta.PREFIX_ROWS)
    rope = {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    merge = {k: decode[k] for k in ("D", "SPLITS", "NUM_HEADS", "TILE", "WINDOW", "CASCADE",
                                    "TOTAL")} | dict(PREFIX_SPLITS=8, ACT=tl.bfloat16)
    prefill = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, D=64, D_PAD=64, BS=16, BLOCK_N=64,
                   WINDOW=0, ZERO_BLOCKS=ta.ZERO_BLOCKS, PRECISION="tf32", SKIP_ONE=True)
    verify = {"verify_ptr": "*i64"}  # speculative decoding: each row's place in its chunk
    return [
        ("decode split", ta._decode_split_kernel, decode, 2, {}),
        ("decode split, verify rows", ta._decode_split_kernel, decode | dict(VERIFY=True), 2,
         verify),
        ("decode one split, verify chunks, rotary", ta._decode_split_kernel,
         decode | dict(SPLITS=1, TOTAL=1, ROPE=True, VERIFY=True, CHUNKS=True),
         ta.CHUNK_WARPS, verify | rope),
        ("decode split, more rows: no PDL, first tile not peeled", ta._decode_split_kernel,
         decode | dict(PEEL=False, PDL=False), 2, {}),
        ("decode split, window", ta._decode_split_kernel, decode | dict(WINDOW=37), 2, {}),
        ("decode split, cascade", ta._decode_split_kernel, cascade, 2, {}),
        ("decode split, FP8 cache", ta._decode_split_kernel,
         decode | dict(STAGES=ta.DECODE_TILES_FP8[2]), ta.DECODE_TILES_FP8[1],
         {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}),
        ("decode one split, FP8 cache, head 128, rotary", ta._decode_split_kernel,
         decode | dict(D=128, SPLITS=1, TOTAL=1, ROPE=True, STAGES=ta.DECODE_TILES_FP8[2]),
         ta.DECODE_TILES_FP8[1], {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} | rope),
        ("decode one split, rotary", ta._decode_split_kernel,
         decode | dict(SPLITS=1, TOTAL=1, ROPE=True), 2, rope),
        ("decode one split, cascade, rotary", ta._decode_split_kernel,
         cascade | dict(SPLITS=1, TOTAL=16, ROPE=True), 2, rope),
        ("decode split, head 256", ta._decode_split_kernel,
         decode | dict(D=256, TILE=ta.decode_tiles(256)[0]), ta.decode_tiles(256)[1], {}),
        ("decode prefix (cascade)", ta._decode_prefix_kernel, prefix, ta.PREFIX_WARPS, {}),
        ("decode prefix (cascade), rotary", ta._decode_prefix_kernel, prefix | dict(ROPE=True),
         ta.PREFIX_WARPS, rope),
        ("decode merge", ta._decode_merge_kernel, merge, 1, {}),
        ("decode merge, float16 rows out", ta._decode_merge_kernel, merge, 1,
         {"out_ptr": "*fp16"}),
        ("decode one split, FP8 cache, head 128, float16 rows out", ta._decode_split_kernel,
         decode | dict(D=128, SPLITS=1, TOTAL=1, ROPE=True, STAGES=ta.DECODE_TILES_FP8[2]),
         ta.DECODE_TILES_FP8[1],
         {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "out_ptr": "*fp16"} | rope),
        ("decode merge, cascade", ta._decode_merge_kernel,
         merge | dict(CASCADE=True, TOTAL=32), 1, {}),
        ("prefill", ta._prefill_kernel, prefill, 4, {}),
        ("prefill, FP8 cache", ta._prefill_kernel, prefill, 4,
         {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}),
        ("prefill, head 80, window", ta._prefill_kernel,
         prefill | dict(D=80, D_PAD=128, WINDOW=37), 8, {}),
    ]


def other_cases() -> list[Case]:
    """The elementwise, skinny-GEMM, FP8 GEMM and LoRA kernels at llama-1b's decode shapes
    (the FP8 GEMM at the 8B's)."""
    from raygraph.model import triton_fp8_gemm as fg
    from raygraph.model import triton_gemv as gv
    from raygraph.model import triton_lora as lr
    from raygraph.model import triton_ops as op

    rope = {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    gemv = dict(N=3072, K=2048, EPILOGUE=gv.ROTARY, HAS_BIAS=False, HEAD_DIM=64,
                ROT_ROWS=2560, FP8=False, GROUP=2048, BM=gv.BM, BN=32, BK=128,
                PRECISION="tf32", F16=gv.X_AS_IS, ACT=tl.bfloat16)
    row = {k: gemv[k] for k in ("N", "K", "HEAD_DIM", "ROT_ROWS", "FP8", "GROUP")}
    # FP8 weights: one scale a row, or one a row and 128 columns
    fp8 = dict(FP8=True)
    fp8_dot = fp8 | dict(F16=gv.X_HALF_ONCE)
    e4m3 = rope | {"w_ptr": "*fp8e4nv"}
    slots = {"order_ptr": "*i32", "slot_ptr": "*i32"}
    w8a8 = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32"}
    quantized = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "fp8_max": "fp32", "inv_max": "fp32",
                 "min_scale": "fp32"}

    def one_token_fp8(name: str, n: int, k: int, epilogue: int) -> Case:
        """The row kernel over an FP8 weight [n, k] (scales a row) at the tile that
        row_config serves it (gate|up: two row sets)."""
        cfg = gv.row_config(n, k, True, 2 if epilogue == gv.SILU_MUL else 1)
        return (name, gv.row_kernel,
                row | fp8 | dict(N=n, K=k, GROUP=k, EPILOGUE=epilogue, HAS_BIAS=False,
                                 BN=cfg.block_n, BK=cfg.block_k, SUM_EACH=cfg.sum_each),
                cfg.num_warps, e4m3)

    return [
        ("rms_norm", op._rms_norm_kernel, dict(BLOCK=2048, QUANT=False, KEEP=True), 4, {}),
        ("add_rms_norm", op._add_rms_norm_kernel, dict(BLOCK=2048, QUANT=False, KEEP=True), 4,
         {}),
        ("add_rms_norm, float16 rows out", op._add_rms_norm_kernel,
         dict(BLOCK=4096, QUANT=False, KEEP=True), 4, {"out_ptr": "*fp16"}),
        ("add_rms_norm, e4m3 rows only", op._add_rms_norm_kernel,
         dict(BLOCK=4096, QUANT=True, KEEP=False), 4,
         quantized),
        ("q/k norms", op._qk_norm_kernel, dict(HQ=32, HK=8, D=128, BLOCK=128), 4, {}),
        ("argmax", op._argmax_kernel, dict(BLOCK=16384), 16, {"out_ptr": "*i64"}),
        ("rotary", op._rotary_kernel,
         dict(HQ=32, HK=8, HQ_PAD=32, HK_PAD=8, HALF=32, HALF_PAD=32), 1, rope),
        ("rotary, head 80", op._rotary_kernel,
         dict(HQ=32, HK=8, HQ_PAD=32, HK_PAD=8, HALF=40, HALF_PAD=64), 1, rope),
        ("silu_and_mul", op._silu_and_mul_kernel, dict(BLOCK=1024), 4, {}),
        ("silu_and_mul + e4m3 rows", op._silu_and_mul_quant_kernel,
         dict(BLOCK=1024, WHOLE=False, KEEP=False), 4, quantized),
        ("silu_and_mul + e4m3 rows, whole", op._silu_and_mul_quant_kernel,
         dict(BLOCK=16384, WHOLE=True, KEEP=False), 16, quantized),
        ("store_kv", op._store_kv_kernel, dict(N=512, BLOCK=512), 1, {"slots_ptr": "*i64"}),
        ("quantize rows to e4m3", op._quantize_rows_kernel, dict(STATIC=False, BLOCK=8192), 8,
         {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "fp8_max": "fp32",
          "inv_max": "fp32", "min_scale": "fp32"}),
        ("skinny gemm + rotary", gv._gemv_kernel, gemv, 4, rope),
        ("skinny gemm + silu*mul", gv._gemv_kernel,
         gemv | dict(N=8192, EPILOGUE=gv.SILU_MUL, BN=64), 4, rope),
        ("row gemv + bias", gv.row_kernel,
         row | dict(EPILOGUE=gv.PLAIN, HAS_BIAS=True, BN=4, BK=2048, SUM_EACH=False), 4, rope),
        ("skinny gemm fp8 + silu*mul", gv._gemv_kernel,
         gemv | fp8_dot | dict(N=8192, EPILOGUE=gv.SILU_MUL, BN=64), 4, e4m3),
        ("skinny gemm fp8 128-groups + rotary", gv._gemv_kernel,
         gemv | fp8_dot | dict(GROUP=128), 4, e4m3),
        ("skinny gemm fp8 128-groups + silu*mul, x converted in the dot", gv._gemv_kernel,
         gemv | fp8 | dict(N=8192, GROUP=128, EPILOGUE=gv.SILU_MUL, BN=64,
                           F16=gv.X_HALF_IN_DOT), 4, e4m3),
        ("skinny gemm fp8 + silu*mul, float16 rows out", gv._gemv_kernel,
         gemv | fp8_dot | dict(N=14336, K=4096, GROUP=4096, EPILOGUE=gv.SILU_MUL, BN=64,
                               BK=256), 4, e4m3 | {"out_ptr": "*fp16"}),
        ("skinny gemm fp8, float16 rows in (the 8B's down)", gv._gemv_kernel,
         gemv | fp8 | dict(N=4096, K=14336, GROUP=14336, EPILOGUE=gv.PLAIN, BK=256), 4,
         e4m3 | {"x_ptr": "*fp16"}),
        ("skinny gemm fp8, the 8B's q|k|v + rotary", gv._gemv_kernel,
         gemv | fp8_dot | dict(N=6144, K=4096, GROUP=4096, HEAD_DIM=128, ROT_ROWS=5120, BN=64,
                               BK=256), 4, e4m3),
        ("skinny gemm fp8, float16 rows in, the 8B's q|k|v + rotary", gv._gemv_kernel,
         gemv | fp8 | dict(N=6144, K=4096, GROUP=4096, HEAD_DIM=128, ROT_ROWS=5120, BN=64,
                           BK=512), 4, e4m3 | {"x_ptr": "*fp16"}),
        ("skinny gemm fp8 + silu*mul, float16 rows in and out", gv._gemv_kernel,
         gemv | fp8 | dict(N=14336, K=4096, GROUP=4096, EPILOGUE=gv.SILU_MUL, BN=64, BK=256),
         4, e4m3 | {"x_ptr": "*fp16", "out_ptr": "*fp16"}),
        ("row gemv fp8 + silu*mul", gv.row_kernel,
         row | fp8 | dict(N=8192, EPILOGUE=gv.SILU_MUL, HAS_BIAS=False, BN=2, BK=1024,
                             SUM_EACH=True), 2,
         e4m3),
        one_token_fp8("row gemv fp8, the 8B's down in one run past K", 4096, 14336, gv.PLAIN),
        one_token_fp8("row gemv fp8, the 70B's down in one run past K", 8192, 28672, gv.PLAIN),
        one_token_fp8("row gemv fp8 + silu*mul, the 70B's gate|up in one run", 28672, 8192,
                      gv.SILU_MUL),
        one_token_fp8("row gemv fp8 + silu*mul, one row a program over 16384", 53248, 16384,
                      gv.SILU_MUL),
        ("row gemv fp8 128-groups + rotary", gv.row_kernel,
         row | fp8 | dict(GROUP=128, EPILOGUE=gv.ROTARY, HAS_BIAS=False, BN=4, BK=2048,
                             SUM_EACH=False), 4,
         e4m3),
        ("W8A8 FP8 GEMM", fg._fp8_gemm_kernel,
         dict(N=4096, K=4096, HAS_BIAS=True, BM=64, BN=32, BK=128, GROUPS=1), 4, w8a8),
        ("W8A8 FP8 GEMM through TMA", fg._fp8_gemm_tma_kernel,
         dict(K=14336, HAS_BIAS=False, BM=64, BN=128, BK=128), 4,
         {"a_desc": "tensordesc<fp8e4nv[64, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>",
          "as_ptr": "*fp32", "bs_ptr": "*fp32"}),
        ("W8A8 FP8 GEMM, 128 x 128 blocks", fg._fp8_gemm_kernel,
         dict(N=4096, K=4096, HAS_BIAS=False, BM=64, BN=64, BK=128, GROUPS=32), 4, w8a8),
        ("W8A8 FP8 GEMM, 128 x 128 blocks, 128 columns", fg._fp8_gemm_kernel,
         dict(N=4096, K=4096, HAS_BIAS=False, BM=64, BN=128, BK=128, GROUPS=32), 4, w8a8),
        ("lora shrink", lr._shrink_kernel, dict(R=16, K=2048, P0=0, P1=2, P2=2, BM=lr.BM,
                                                BN=16, BK=512, PRECISION="tf32"), 4, slots),
        ("lora expand", lr._expand_kernel, dict(N0=2048, N1=512, N2=0, C0=0, C1=2560, C2=2560,
                                                P0=0, P1=2, P2=2, R=16, BM=lr.BM, BN=128,
                                                BK=16, PRECISION="tf32"), 2, slots),
    ]


def no_byte_gathers(ptx: str) -> str | None:
    """An FP8 V tile reaches the tensor cores as float16 through `ldmatrix`, never gathered
    from shared memory a byte at a time (triton_attention._values)."""
    if re.search(r"ld\.shared(\.v[24])?\.b8\b", ptx):
        return "reads its V tiles a byte at a time"
    return None


# PTX checks by case: at the 8B's head (at 64 the newest key's fold, after the loop, gathers a
# few bytes)
PTX_CHECKS = {"decode one split, FP8 cache, head 128, rotary": no_byte_gathers}


def main() -> int:
    cases = attention_cases() + other_cases()
    unknown = set(PTX_CHECKS) - {name for name, *_ in cases}
    if unknown:
        raise AssertionError(f"PTX checks for no case: {sorted(unknown)}")
    for name, fn, constexprs, warps, types in cases:
        kernel = compile_kernel(fn, constexprs, warps, types)
        problem = PTX_CHECKS[name](kernel.asm["ptx"]) if name in PTX_CHECKS else None
        if problem:
            raise AssertionError(f"{name}: {problem}")
        print(f"compiled {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

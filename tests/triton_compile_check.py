"""Compile the one-row GEMV kernels (and the tiled ones' split-K) for Hopper (sm_90) without a
GPU: Triton's ahead-of-time path (ASTSource -> TTIR -> PTX -> cubin through the ptxas its
wheel ships). The interpreter runs the kernels' Python, not the compiler, so this is what
catches a construct that only the compiled path rejects (the lop3 kernel's inline PTX among
them), and it shows the PTX of the one-launch split-K reduction: the partial stored, a CTA
barrier, then the acquire-release atomic, and the partials read back at L2 (ld.global.cg).

    python tests/triton_compile_check.py      (TRITON_INTERPRET unset; prints "ok")

The joined 4-bit tiles' K loop leaves its wgmmas in flight across steps
(`check_dots_stay_in_flight`: the reason `GemmConfig.join` exists).

It also compiles the KV store, rotary store and attention kernels over a float8 e4m3 pool
(`check_float8_kv_cache`): the rounding instruction of the stores, the widening of the loads.

Run by tests/test_quant_triton_splitk.py in a child process (its own process has the kernels
decorated for the interpreter).
"""

from __future__ import annotations

import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sgl.backend.kernels import (triton_activation, triton_argmax, triton_attention_decode,
                                 triton_attention_extend, triton_kv_store, triton_rmsnorm,
                                 triton_rotary)
from sgl.backend.quant import (triton_fp8, triton_gemm, triton_gemv, triton_q4gemv, triton_q4mma,
                               triton_split)

TARGET = GPUTarget("cuda", 90, 32)
QGEMV_ARGS = {"X": "*bf16", "CODES": "*u8", "SCALE": "*i8", "ZERO": "*i8", "SUP_S": "*fp32",
              "SUP_Z": "*fp32", "B": "*bf16", "Y": "*bf16", "P": "*fp32", "CNT": "*i32",
              "N": "i32", "G": "i32", "SLICE_G": "i32", "stride_xm": "i32", "stride_cn": "i32",
              "stride_ym": "i32", "stride_ps": "i32"}
FP8_ARGS = {"X": "*bf16", "W": "*fp8e4nv", "SCALE": "*fp32", "B": "*bf16", "Y": "*bf16",
            "P": "*fp32", "CNT": "*i32", "N": "i32", "K": "i32", "SLICE_K": "i32",
            "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "stride_ps": "i32"}


def ptx(kernel: Any, args: dict[str, str], consts: dict[str, Any], aligned: bool = False,
        num_warps: int = 4, num_stages: int = 3) -> str:
    """`aligned`: pointers, strides, N, K, the group count G and the split slices' sizes
    divisible by 16, as Triton specializes them at launch for the 8B shapes (what lets loads
    become 16-byte vectors and pipelined copies)."""
    signature = {**args, **{name: "constexpr" for name in consts}}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in
             args.items() if aligned and (kind.startswith("*") or name.startswith("stride")
                                          or name in ("N", "K", "G", "SLICE_G", "SLICE_K"))}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts,
                                        attrs=attrs),
                              target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm.get("cubin"), "no cubin"
    return compiled.asm["ptx"]


def check_last_slice_reduction(code: str) -> None:
    """A barrier between the partial's store and the counter's atomic; coherent reads after."""
    lines = code.splitlines()
    atom = next(i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line)
    store = max(i for i, line in enumerate(lines[:atom]) if "st.global" in line)
    assert any("bar.sync" in line for line in lines[store:atom]), "no barrier before the atom"
    assert any("ld.global.cg" in line for line in lines[atom:]), "partials not read at L2"


def k_loop(code: str) -> list[str]:
    """The PTX lines of a kernel's first loop (its K loop in the tiled kernels): from the
    loop header's label to the branch that closes it."""
    lines = code.splitlines()
    head = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    end = next(i for i in range(head + 1, len(lines)) if " bra" in lines[i])
    return lines[head:end + 1]


def check_dots_stay_in_flight(code: str) -> None:
    """The K loop issues wgmmas and never waits for all of them (`wgmma.wait_group 0`) before
    its next step: the next tile's dequantization overlaps the tensor cores' work. (The tiled
    4-bit kernel's two-dot step waits for the first dot's wgmmas before the second; the
    joined step was built to avoid that: triton_gemm's module docstring.)"""
    loop = "\n".join(k_loop(code))
    assert "wgmma.mma_async" in loop, "no wgmma in the K loop"
    assert not re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", loop), "a full wait per step"


def check_loads_around_wait(code: str) -> None:
    """PDL: a load (a weight, the step's inputs) before griddepcontrol.wait, and no store
    before it."""
    lines = code.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert any("ld.global" in line for line in lines[:wait]), "no load before the wait"
    assert not any("st.global" in line for line in lines[:wait]), "a store before the wait"


def i32(*names: str) -> dict[str, str]:
    return {name: "i32" for name in names}


def decode_stage1(types: dict[str, str], consts: dict[str, Any]) -> str:
    """Decode attention's stage-1 kernel for the 8B shape's heads, its tensors bf16 but for
    `types` (name -> type), with `consts` (DIRECT, MERGE, PDL, WAIT)."""
    pointers = {name: "*bf16" for name in ("Q", "K", "V", "Out")}
    pointers.update({name: "*fp32" for name in ("MidO", "MidLse")}, **types)
    return ptx(triton_attention_decode._decode_stage1,
               {**pointers, "ReqToToken": "*i32", "Counters": "*i32",
                **{name: "*i64" for name in ("ReqPoolIdx", "SeqLens")},
                **i32("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                      "stride_vh", "stride_r2t", "stride_mob", "stride_moh", "stride_mos",
                      "stride_mlb", "stride_mlh", "stride_ob", "stride_oh"),
                "qk_scale": "fp32", **i32("group", "head_dim", "head_dim_v", "num_splits")},
               dict(BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, BLOCK_DV=128, BLOCK_G=4, BLOCK_C=8,
                    UPCAST=False, IEEE=False, **{"INPUTS_FIRST": True, "LINES": 2, **consts}))


# rotary + KV store for the 8B shape's heads, over a bf16 pool
ROTARY_KV_STORE_ARGS = {
    "Pos": "*i64", "Q": "*bf16", "K": "*bf16", "V": "*bf16", "Cache": "*bf16", "KBuf": "*bf16",
    "VBuf": "*bf16", "Loc": "*i64",
    **i32("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
          "stride_cache", "stride_kbs", "stride_kbh", "stride_vbs", "stride_vbh", "num_q_heads",
          "num_k_heads", "half", "head_dim_v")}
ROTARY_KV_STORE_CONSTS = dict(BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, BLOCK_DV=128,
                              INPUTS_FIRST=True)


def check_float8_kv_cache() -> None:
    """A float8 e4m3 pool (kv_cache_dtype="fp8_e4m3"): the stores round each bf16 value once,
    to nearest even and saturated (the reference's `to_pool_dtype`); the rotary store rounds
    the fp32 rotation to bf16 first, as the unfused path stores it; the attention kernels
    widen the codes they load and still dot bf16 on the tensor cores."""
    store = ptx(triton_kv_store._kv_store_kernel,
                {"K": "*bf16", "V": "*bf16", "KBuf": "*fp8e4nv", "VBuf": "*fp8e4nv",
                 "Loc": "*i64", **i32("stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                      "stride_kbs", "stride_kbh", "stride_vbs", "stride_vbh",
                                      "num_heads", "head_dim", "head_dim_v")},
                dict(BLOCK_H=8, BLOCK_D=128, BLOCK_DV=128, PDL=False, WAIT=False))
    rotary_args = {**ROTARY_KV_STORE_ARGS, "KBuf": "*fp8e4nv", "VBuf": "*fp8e4nv"}
    rotary_consts = dict(ROTARY_KV_STORE_CONSTS, PDL=False, WAIT=False)
    rotary = ptx(triton_rotary._rotary_kv_store_kernel, rotary_args, rotary_consts)
    rotary_bf16 = ptx(triton_rotary._rotary_kv_store_kernel,
                      {**rotary_args, "KBuf": "*bf16", "VBuf": "*bf16"}, rotary_consts)
    for code in (store, rotary):
        cvts = {line.split()[0] for line in code.splitlines() if line.strip().startswith("cvt.")
                and "e4m3" in line}
        assert cvts == {"cvt.rn.satfinite.e4m3x2.f32"}, f"fp8 stores convert by {cvts}"
    # The rotated k rounded to bf16: as many fp32 -> bf16 roundings as into a bf16 pool.
    def to_bf16(code: str) -> int:
        return code.count("cvt.rn.bf16.f32") + 2 * code.count("cvt.rn.bf16x2.f32")

    assert to_bf16(rotary) == to_bf16(rotary_bf16) > 0, "rotated k not rounded to bf16 first"
    decode = decode_stage1(dict(Q="*bf16", K="*fp8e4nv", V="*fp8e4nv", Out="*bf16"),
                           dict(DIRECT=False, MERGE=False, PDL=False, WAIT=False))
    extend = ptx(triton_attention_extend._extend_kernel,
                 {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "Out": "*bf16",
                  "ReqToToken": "*i32", **{name: "*i64" for name in (
                      "ReqPoolIdx", "SeqLens", "PrefixLens", "ExtendLens", "ExtendStart")},
                  **i32("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                        "stride_vh", "stride_ot", "stride_oh", "stride_r2t"),
                  "qk_scale": "fp32", **i32("group", "head_dim", "head_dim_v")},
                 dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, BLOCK_DV=128, UPCAST=False,
                      IEEE=False))
    for code in (decode, extend):
        # e4m3x2 -> f16x2 -> bf16, both exact; the dots: mma.sync (decode, 16 rows), wgmma
        assert "cvt.rn.f16x2.e4m3x2" in code, "the float8 codes are not widened by the hardware"
        assert re.search(r"mma\S*\.f32\.bf16\.bf16", code), "no bf16 tensor-core dot"


def main() -> None:
    check_float8_kv_cache()
    q4 = dict(BITS=4, GROUP=32, GBYTES=16, SUPER=8, HAS_BIAS=True, BLOCK_N=32, BLOCK_G=16,
              EVEN_G=True, EVEN=False, MAGIC=False, WORDS=False, LANES=16, ROWS_FIRST=True)
    q8 = dict(q4, BITS=8, GROUP=16, SUPER=16, BLOCK_G=32, MAGIC=True, WORDS=True, LANES=4)
    for consts, last in ((dict(q4, SPLIT=4, LAST=True), True),
                         (dict(q8, SPLIT=2, LAST=False), False)):
        codes = "*i32" if consts["WORDS"] else "*u8"  # (int32 words: qgemv's view)
        code = ptx(triton_gemv._qgemv_kernel, {**QGEMV_ARGS, "CODES": codes}, consts)
        if last:
            check_last_slice_reduction(code)
    # The lop3 kernel: its inline and-or survives to the PTX (one lop3 per code), split too.
    lop3 = dict(SUPER=8, HAS_BIAS=True, BLOCK_N=16, BLOCK_G=32, EVEN=False, ROWS_FIRST=True,
                SPLIT=2, LAST=True, ASM=True, PREFETCH=True)
    code = ptx(triton_q4gemv.q4_lop3_kernel, {**QGEMV_ARGS, "CODES": "*i32"}, lop3)
    assert code.count("lop3.b32") >= 8, "the codes are not unpacked by lop3"
    check_last_slice_reduction(code)
    # The tensor-core kernel: its inline dequantization (lop3, then a bf16x2 FMA per pair)
    # feeds the MMA (wgmma on sm_90 at 64 rows a program); two rows of x, split too.
    mma = dict(SUPER=8, HAS_BIAS=True, BLOCK_N=64, BLOCK_G=8, EVEN=False, ROWS=2, ROWS2=2,
               XCOLS=16, SPLIT=2, LAST=True, ASM=True, UPCAST=False)
    code = ptx(triton_q4mma.q4_mma_kernel, {**QGEMV_ARGS, "CODES": "*u8"}, mma)
    assert code.count("fma.rn.bf16x2") >= 2 and "wgmma.mma_async" in code, "no bf16 MMA path"
    check_last_slice_reduction(code)
    fp8 = dict(HAS_BIAS=False, BLOCK_N=16, BLOCK_K=512, EVEN_N=True, EVEN_K=False, DECODE=0,
               ROWS_FIRST=False, PDL=False, LET_NEXT=0)
    check_last_slice_reduction(ptx(triton_fp8._fp8_gemv_kernel, FP8_ARGS,
                                   dict(fp8, SPLIT=8, LAST=True)))
    # The FP8 word kernel: the hardware e4m3x2 conversions survive to the PTX (two per word).
    # Launched early (PDL): the first weights load before the wait, x after it; the kernel
    # after may launch before the sums are stored (LET_NEXT 1: once the K loop is done; 2: as
    # a program starts).
    words = dict(HAS_BIAS=True, BLOCK_N=8, BLOCK_K=1024, EVEN_N=False, EVEN_K=False,
                 X_PAIRS=True, ASM=True, ROWS_FIRST=False, PDL=True, LET_NEXT=1)
    code = ptx(triton_fp8._fp8_words_kernel, {**FP8_ARGS, "W": "*i32"},
               dict(words, SPLIT=2, LAST=True))
    assert code.count("cvt.rn.f16x2.e4m3x2") >= 2, "e4m3 not converted by the hardware"
    check_last_slice_reduction(code)
    for code in (code, ptx(triton_fp8._fp8_gemv_kernel, FP8_ARGS,
                           dict(fp8, PDL=True, LET_NEXT=2, SPLIT=1, LAST=False))):
        check_loads_around_wait(code)
        lines = code.splitlines()
        trigger = next(i for i, line in enumerate(lines)
                       if "griddepcontrol.launch_dependents" in line)
        assert trigger < min(i for i, line in enumerate(lines) if "st.global" in line), \
            "the kernel after launches only once the sums are stored"
    # Unmasked tiles at aligned shapes: the weights load as 16-byte vectors (a constexpr lost
    # on the way to the load, e.g. through a local `a and b`, makes it one byte per load).
    even = dict(HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024, EVEN_N=True, EVEN_K=True,
                ROWS_FIRST=False, SPLIT=1, LAST=False, PDL=False, LET_NEXT=0)
    for kernel, args, consts in ((triton_fp8._fp8_gemv_kernel, FP8_ARGS, dict(even, DECODE=0)),
                                 (triton_fp8._fp8_words_kernel, {**FP8_ARGS, "W": "*i32"},
                                  dict(even, X_PAIRS=True, ASM=True))):
        code = ptx(kernel, args, consts, aligned=True)
        assert code.count("ld.global.v4.b32") >= 4, "weights not loaded as 16-byte vectors"
        assert "ld.global.b8" not in code and "ld.global.u8" not in code, "byte loads"
    # The kernels before the GEMVs let them launch early: the trigger is in their PTX; launched
    # early themselves (SMALL_EARLY_SWITCH), they wait for the kernel before.
    norm = ptx(triton_rmsnorm._rmsnorm_kernel,
               {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Out": "*bf16", "ResOut": "*bf16",
                "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32",
                "hidden": "i32", "eps": "fp32"},
               dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=True, WAIT=True, INPUTS_FIRST=True))
    # (its weight, a parameter, is read before the wait: the first load of the kernel)
    lines = norm.splitlines()
    first_load = next(i for i, line in enumerate(lines) if "ld.global" in line)
    wait_at = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert first_load < wait_at, "the norm's weight is not loaded before the wait"
    rotary = ptx(triton_rotary._rotary_kv_store_kernel, ROTARY_KV_STORE_ARGS,
                 dict(ROTARY_KV_STORE_CONSTS, PDL=True, WAIT=True))
    silu = ptx(triton_activation._silu_and_mul_kernel,
               {"X": "*bf16", "Out": "*bf16", "stride_xt": "i32", "stride_ot": "i32",
                "inter": "i32"}, dict(BLOCK=1024, PDL=True, WAIT=True))
    # Decode attention with one split writes the output from stage 1 (no stage 2 after it).
    attn = decode_stage1({}, dict(DIRECT=True, MERGE=False, PDL=True, WAIT=True))
    # More splits, one launch: merged by the last program (after a barrier and the counter's
    # atomic, the partials read back at L2).
    fused = decode_stage1({}, dict(DIRECT=False, MERGE=True, PDL=True, WAIT=True))
    check_last_slice_reduction(fused)
    # (merging, it lets the GEMV after launch once its loop is done, not as it starts)
    lines = fused.splitlines()
    assert (min(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
            > min(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)), \
        "the merging stage 1 lets the next kernel launch before its loop"
    for code in (norm, silu, rotary, attn, fused):
        assert "griddepcontrol.launch_dependents" in code, "no early launch"
        assert "griddepcontrol.wait" in code, "no wait for the kernel before"
    # Before the wait (triton_compat.INPUTS_FIRST): rotary loads its token's inputs, decode
    # attention its lengths and table slots and prefetches its first tile's rows; nothing is
    # stored there.
    check_loads_around_wait(rotary)
    for code in (attn, fused):
        check_loads_around_wait(code)
        lines = code.splitlines()
        wait_at = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert sum("prefetch.global.L2" in line for line in lines[:wait_at]) >= 2, \
            "no prefetch of the first tile's keys and values before the wait"
    # The tiled kernels split along K (both operand orders), the tile's last slice adding.
    tiled = {"M": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_ps": "i32"}
    for w_as_a in (False, True):
        common = dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, UPCAST=False, IEEE=False,
                      W_AS_A=w_as_a, SPLIT=4, LAST=True)
        for join in (False, True):  # 4-bit: two dots per K step, or one over both halves
            consts = dict(common, BITS=4, GROUP=32, GBYTES=16, SUPER=8, BLOCK_G=4, JOIN=join)
            check_last_slice_reduction(ptx(triton_gemm._qgemm_kernel,
                                           {**QGEMV_ARGS, **tiled}, consts))
            if join and w_as_a:  # (64 weight rows: the wgmma's M; aligned as the 8B shapes)
                check_dots_stay_in_flight(ptx(triton_gemm._qgemm_kernel,
                                              {**QGEMV_ARGS, **tiled}, consts, aligned=True))
        check_last_slice_reduction(ptx(triton_fp8._fp8_gemm_kernel, {**FP8_ARGS, **tiled},
                                       dict(common, BLOCK_K=128)))
    ptx(triton_split._reduce_kernel, {"P": "*fp32", "B": "*bf16", "Y": "*bf16", "N": "i32",
                                      "stride_ps": "i32", "stride_ym": "i32"},
        dict(HAS_BIAS=True, SPLIT=4, BLOCK=triton_split.REDUCE_BLOCK))
    # The greedy argmax: each slice's pair stored, a barrier, the row's counter, the last
    # program reading the pairs at L2.
    check_last_slice_reduction(ptx(
        triton_argmax._argmax_kernel,
        {"X": "*fp32", "Keys": "*i32", "Idx": "*i32", "Counters": "*i32", "Out": "*i64",
         "stride_x": "i32", "vocab": "i32", "slices": "i32"},
        dict(BLOCK=triton_argmax.BLOCK, BLOCK_S=32), num_warps=8))
    print("ok")


if __name__ == "__main__":
    main()

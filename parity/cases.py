"""The named case sets of the parity suite.

``QUICK`` is a smoke test of every implementation on a CPU (Pallas kernels interpreted):
small shapes, lengths <= 128. ``FULL`` is the sweep for a GPU: lengths up to 2048, head
dims 40 to 256, all three dtypes.

Both carry FlashTile's own test configurations, expressed through jaxtile's API (its
block sizes 32/64/128, its sliding windows via `flashtile_window`, GQA with 8 query and
2 kv heads, MQA, prime lengths, a single token, one less and one more than a tile), and
edge cases FlashTile never tested (fully masked rows, head dims 40/80/96/256,
``q_len != kv_len``, large logits). Case names say which: ``flashtile_*`` or ``edge_*``
(``api_*`` for the rest of jaxtile's features; ``api_paged_*`` run through
``jaxtile.paged_attention``). Every block is a power of two >= 16 or None, so each case
is valid for the Pallas kernels too.
"""

from __future__ import annotations

from parity.case import Case

F32, BF16, F16 = "float32", "bfloat16", "float16"


def flashtile_window(window_size: int, *, causal: bool) -> tuple[int, int]:
    """jaxtile's ``window`` for FlashTile's ``SlidingWindowAttention(window_size, causal)``."""
    return (window_size - 1, 0) if causal else (window_size // 2, window_size // 2)


def _checked(*cases: Case) -> tuple[Case, ...]:
    """The cases, after checking that names are unique and blocks are Pallas-valid."""
    names = [case.name for case in cases]
    if duplicates := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"case names must be unique; repeated: {duplicates}")
    for case in cases:
        for block in (case.block_q, case.block_k):
            if block is not None and (block < 16 or block & (block - 1)):
                raise ValueError(f"{case.name}: {block=} is not a power of two >= 16")
    return cases


QUICK = _checked(
    Case(
        "flashtile_causal_block64", batch=(1,), num_heads=2, q_len=128, head_dim=64, causal=True, block_q=64, block_k=64
    ),
    Case(
        "flashtile_sliding_causal_w32",
        batch=(1,),
        num_heads=2,
        q_len=128,
        head_dim=64,
        causal=True,
        window=flashtile_window(32, causal=True),
        block_q=32,
        block_k=32,
    ),
    Case(
        "flashtile_sliding_w32_bf16",
        batch=(1,),
        num_heads=2,
        q_len=128,
        head_dim=64,
        window=flashtile_window(32, causal=False),
        dtype=BF16,
        block_q=32,
        block_k=32,
    ),
    Case(
        "flashtile_gqa_8q_2kv_causal_segments",
        batch=(1,),
        num_heads=8,
        num_kv_heads=2,
        q_len=64,
        causal=True,
        segments=3,
        block_q=32,
        block_k=32,
    ),
    Case("flashtile_mqa_fp16", num_heads=4, num_kv_heads=1, q_len=64, dtype=F16, block_q=32, block_k=32),
    Case("flashtile_prime_127", batch=(1,), num_heads=2, q_len=127, head_dim=64, causal=True, block_q=32, block_k=32),
    # One key per query: the exact dq and dk through the output are 0 (only rounding
    # residue to compare), so the lse cotangent gives them a value to check.
    Case("flashtile_single_token", batch=(1,), num_heads=2, q_len=1, head_dim=64, lse_grad=True),
    Case("flashtile_tile_minus_one", batch=(1,), num_heads=2, q_len=63, head_dim=64, block_q=64, block_k=64),
    Case(
        "flashtile_tile_plus_one_d96",
        batch=(1,),
        num_heads=2,
        q_len=65,
        head_dim=96,
        causal=True,
        block_q=64,
        block_k=64,
    ),
    Case(
        "edge_fully_masked_rows_lse_grad",
        batch=(1,),
        num_heads=2,
        q_len=48,
        kv_len=80,
        mask="empty_rows",
        lse_grad=True,
        block_q=16,
        block_k=32,
    ),
    Case(
        "edge_q_shorter_causal_d40",
        batch=(1,),
        num_heads=2,
        q_len=32,
        kv_len=112,
        head_dim=40,
        causal=True,
        block_q=16,
        block_k=32,
    ),
    Case(
        "edge_kv_shorter_d80_v48",
        batch=(1,),
        num_heads=2,
        q_len=96,
        kv_len=40,
        head_dim=80,
        head_dim_v=48,
        block_q=32,
        block_k=16,
    ),
    Case(
        "edge_head_dim_256_bf16",
        batch=(1,),
        num_heads=1,
        q_len=32,
        kv_len=48,
        head_dim=256,
        dtype=BF16,
        block_q=16,
        block_k=16,
    ),
    # Logits ~1e3, far past exp's float32 overflow, but with a softmax that is not one-hot
    # in every row, so the gradients are not all cancellation residue (see Case.grads).
    Case("edge_large_logits", batch=(1,), num_heads=2, q_len=64, input_scale=20.0, block_q=32, block_k=32),
    # Paged caches: a decode step over caches filled to different lengths (72 is not a
    # multiple of the page), and a ragged causal chunk of a prefill.
    Case(
        "api_paged_decode_gqa_kv_lengths",
        batch=(3,),
        num_heads=8,
        num_kv_heads=2,
        q_len=1,
        kv_len=72,
        lengths="kv",
        page_size=16,
    ),
    Case(
        "api_paged_chunk16_mqa_causal_ragged_bf16",
        batch=(3,),
        num_heads=4,
        num_kv_heads=1,
        q_len=16,
        kv_len=96,
        causal=True,
        lengths="ragged",
        page_size=32,
        dtype=BF16,
    ),
    # Learnable attention sinks (gpt-oss): contiguous with a window, and paged decode.
    Case(
        "api_sinks_gqa_window_causal", num_heads=8, num_kv_heads=2, q_len=100, causal=True, window=(31, 0), sinks=True
    ),
    Case(
        "api_paged_decode_sinks_kv_lengths",
        batch=(3,),
        num_heads=8,
        num_kv_heads=2,
        q_len=1,
        kv_len=72,
        lengths="kv",
        sinks=True,
        page_size=16,
    ),
    # An additive bias, read tile by tile, and its gradient: one shared by every
    # sequence and head (a relative-position bias), and one per sequence and head.
    Case("api_bias_shared_gqa_causal", num_heads=8, num_kv_heads=2, q_len=100, causal=True, bias="shared"),
    Case("api_bias_full_window", q_len=90, kv_len=120, window=(20, 5), bias="full", dtype=BF16),
)


def _causal(causal: bool) -> str:
    return "_causal" if causal else ""


FULL = _checked(
    # FlashTile's block sizes, on lengths one below and above a tile and a prime.
    *(
        Case(
            f"flashtile_block{block}_len{length}{_causal(causal)}",
            num_heads=4,
            q_len=length,
            head_dim=64,
            causal=causal,
            block_q=block,
            block_k=block,
        )
        for block in (32, 64, 128)
        for length in (block - 1, block + 1, 1021)
        for causal in (False, True)
    ),
    # FlashTile's prime lengths, with default blocks.
    *(
        Case(f"flashtile_prime_{length}_causal", num_heads=4, q_len=length, head_dim=64, causal=True)
        for length in (127, 251, 509, 1021)
    ),
    Case("flashtile_prime_509_fp16", num_heads=4, q_len=509, head_dim=64, dtype=F16),
    Case("flashtile_prime_1021_causal_bf16", num_heads=4, q_len=1021, head_dim=64, causal=True, dtype=BF16),
    # Long sequences in every dtype.
    *(
        Case(
            f"flashtile_len2048{_causal(causal)}_{dtype}",
            batch=(1,),
            num_heads=8,
            q_len=2048,
            head_dim=64,
            causal=causal,
            dtype=dtype,
        )
        for dtype in (F32, BF16, F16)
        for causal in (False, True)
    ),
    # FlashTile's sliding windows, causal (W - 1, 0) and bidirectional (W // 2, W // 2).
    *(
        Case(
            f"flashtile_sliding_w{size}{_causal(causal)}_{dtype}",
            num_heads=4,
            q_len=1024,
            head_dim=64,
            causal=causal,
            window=flashtile_window(size, causal=causal),
            dtype=dtype,
        )
        for size in (64, 256)
        for causal in (False, True)
        for dtype in (F32, BF16)
    ),
    Case(
        "flashtile_sliding_w128_causal_block32",
        q_len=1021,
        num_heads=4,
        head_dim=64,
        causal=True,
        window=flashtile_window(128, causal=True),
        block_q=32,
        block_k=32,
    ),
    Case(
        "flashtile_sliding_w128_block128",
        q_len=1021,
        num_heads=4,
        head_dim=64,
        window=flashtile_window(128, causal=False),
        block_q=128,
        block_k=128,
    ),
    # GQA with 8 query and 2 kv heads, and MQA.
    *(
        Case(
            f"flashtile_{kind}_len1021{_causal(causal)}_{dtype}",
            num_heads=8,
            num_kv_heads=kv_heads,
            q_len=1021,
            head_dim=64,
            causal=causal,
            dtype=dtype,
        )
        for kind, kv_heads in (("gqa_8q_2kv", 2), ("mqa_8q", 1))
        for causal in (False, True)
        for dtype in (F32, BF16)
    ),
    Case(
        "flashtile_gqa_8q_2kv_sliding_w256_causal",
        num_heads=8,
        num_kv_heads=2,
        q_len=2048,
        batch=(1,),
        head_dim=64,
        causal=True,
        window=flashtile_window(256, causal=True),
        dtype=BF16,
    ),
    # A single token (with an lse cotangent: through the output alone dq and dk are 0).
    Case("flashtile_single_token", num_heads=4, q_len=1, head_dim=64, lse_grad=True),
    Case(
        "flashtile_single_token_causal_bf16", num_heads=4, q_len=1, head_dim=64, causal=True, lse_grad=True, dtype=BF16
    ),
    # Head dims FlashTile never tested, in every dtype.
    *(
        Case(
            f"edge_head_dim_{head_dim}_causal_{dtype}",
            num_heads=4,
            q_len=512,
            head_dim=head_dim,
            causal=True,
            dtype=dtype,
        )
        for head_dim in (40, 64, 80, 96, 128, 256)
        for dtype in (F32, BF16, F16)
    ),
    Case("edge_head_dim_128_v64", num_heads=4, q_len=512, head_dim=128, head_dim_v=64),
    # q_len != kv_len: decoding, chunked prefill, and more queries than keys.
    Case("edge_decode_1_of_2048_causal", num_heads=8, num_kv_heads=2, q_len=1, kv_len=2048, head_dim=128, causal=True),
    Case(
        "edge_prefill_128_of_2048_causal_bf16",
        num_heads=8,
        q_len=128,
        kv_len=2048,
        head_dim=128,
        causal=True,
        dtype=BF16,
    ),
    Case("edge_prefill_509_of_1021_window", num_heads=4, q_len=509, kv_len=1021, head_dim=64, window=(100, 20)),
    Case("edge_q_longer_1024_of_256_causal", num_heads=4, q_len=1024, kv_len=256, head_dim=64, causal=True),
    Case("edge_q_longer_1021_of_509", num_heads=4, q_len=1021, kv_len=509, head_dim=80),
    # Fully masked rows and dense masks.
    *(
        Case(f"edge_fully_masked_rows_{dtype}", num_heads=4, q_len=512, head_dim=64, mask="empty_rows", dtype=dtype)
        for dtype in (F32, BF16)
    ),
    Case(
        "edge_fully_masked_rows_lse_grad",
        num_heads=4,
        q_len=509,
        kv_len=1021,
        head_dim=64,
        mask="empty_rows",
        lse_grad=True,
    ),
    Case("api_mask_padding_causal", num_heads=4, q_len=1024, head_dim=64, mask="padding", causal=True),
    Case("api_mask_random_cross", num_heads=4, q_len=500, kv_len=700, head_dim=64, mask="random"),
    # Large logits: ~1e3 with every quantity compared, and ~1e4 (a one-hot softmax) with
    # outputs and lse compared but gradients only finite (see Case.grads).
    Case("edge_large_logits", num_heads=4, q_len=1024, head_dim=64, input_scale=20.0),
    *(
        Case(
            f"edge_logits_1e4_{dtype}",
            num_heads=4,
            q_len=1024,
            head_dim=64,
            input_scale=100.0,
            dtype=dtype,
            grads=False,
        )
        for dtype in (F32, BF16, F16)
    ),
    # The rest of the API.
    Case(
        "api_segments_causal_bf16",
        batch=(1,),
        num_heads=8,
        q_len=2048,
        head_dim=64,
        segments=5,
        causal=True,
        dtype=BF16,
    ),
    Case("api_segments_cross", num_heads=4, q_len=300, kv_len=700, head_dim=64, segments=3),
    # A bias with packed documents and a bottom-right causal mask, where both second
    # opinions take all three (SDPA through one float attn_mask).
    Case(
        "api_bias_shared_segments_gqa_causal_bf16",
        batch=(2,),
        num_heads=8,
        num_kv_heads=2,
        q_len=200,
        segments=3,
        causal=True,
        bias="shared",
        dtype=BF16,
    ),
    *(
        Case(
            f"api_soft_cap_causal_{dtype}",
            num_heads=4,
            q_len=1024,
            head_dim=64,
            causal=True,
            logits_soft_cap=30.0,
            input_scale=3.0,
            dtype=dtype,
        )
        for dtype in (F32, BF16)
    ),
    Case("api_lse_cotangent_causal", num_heads=4, q_len=1021, head_dim=64, causal=True, lse_grad=True),
    Case("api_custom_scale", num_heads=4, q_len=512, head_dim=64, scale=0.3),
    Case("api_no_batch_dims", batch=(), num_heads=4, q_len=1024, head_dim=64, causal=True),
    Case("api_two_batch_dims", batch=(2, 3), num_heads=2, q_len=509, head_dim=64, causal=True),
    # Paged caches: decode steps and prefill chunks over caches of different fills (the
    # first full, the last empty; 1000 is not a multiple of the page), GQA 8:2.
    *(
        Case(
            f"api_paged_q{q_len}_{lengths}_page{page_size}_{dtype}",
            batch=(4,),
            num_heads=8,
            num_kv_heads=2,
            q_len=q_len,
            kv_len=1000,
            head_dim=128,
            causal=True,
            lengths=lengths,
            page_size=page_size,
            dtype=dtype,
        )
        for q_len in (1, 3, 16)
        for lengths in ("kv", "ragged")
        for page_size, dtype in ((16, F32), (32, BF16))
    ),
    Case(
        "api_paged_decode_mqa_window_soft_cap",
        batch=(4,),
        num_heads=8,
        num_kv_heads=1,
        q_len=1,
        kv_len=2048,
        head_dim=64,
        causal=True,
        window=(255, 0),
        logits_soft_cap=30.0,
        input_scale=3.0,
        lengths="kv",
        page_size=16,
    ),
    Case(
        "api_paged_chunk64_full_caches_bf16",
        batch=(2,),
        num_heads=8,
        num_kv_heads=2,
        q_len=64,
        kv_len=1021,
        head_dim=64,
        causal=True,
        page_size=32,
        dtype=BF16,
    ),
    # gpt-oss's attention: GQA 64:8 at head_dim 64 with sinks, every other layer a
    # 128-token window (here 8:1 heads).
    *(
        Case(
            f"api_sinks_gpt_oss{'_window' if window else ''}_bf16",
            batch=(1,),
            num_heads=8,
            num_kv_heads=1,
            q_len=1024,
            head_dim=64,
            causal=True,
            window=window,
            sinks=True,
            dtype=BF16,
        )
        for window in (None, (127, 0))
    ),
)

CASE_SETS = {"quick": QUICK, "full": FULL}


def select(cases: tuple[Case, ...], substring: str = "") -> tuple[Case, ...]:
    """The cases whose name contains ``substring``."""
    return tuple(case for case in cases if substring in case.name)

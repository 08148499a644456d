"""Rotary embedding of the queries and keys, and the staging of the window's keys and values.

Where the model uses it: right after a layer's q/k/v product (lopa.model.transformer.Attention).
The reference rotates q and k together (a product, a roll and an addcmul: three kernels and a
rolled copy on a GPU); the Triton kernel reads the product's output once per head, rotates in
registers and writes q and k in the layout the reference returns. Given a staging destination it
also writes each token's rotated keys and its values to their rows there, where the reference
copies them after it (index_copy_), so a batched round's window K/V reach its staging buffer in
the same kernel.

Serves: head dims that are powers of two up to MAX_HEAD_DIM; any number of tokens and heads; the
model's dtypes. Arithmetic: x * cos + rotate_half(x) * sin in fp32, rounded once: the reference's
bits in fp32 (up to the order of one addition), within one unit of the last place in bf16 (the
reference rounds x * cos first).
"""

from __future__ import annotations

import torch

from lopa.kernels.triton_support import cdiv, kernel, next_power_of_two, tl

MAX_HEAD_DIM = 256
HEAD_BLOCK = 8  # heads per program, at most
TILE_ROWS = 32  # (token, head) pairs per program

# Where a forward's window keys/values are staged: (keys [S, kv_heads, D], values [S, kv_heads, D],
# rows [T]): token t goes to row rows[t] of both.
Staging = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, head_dim]; cos / signed_sin(sin) [B, T, head_dim] (rotate-half layout).

    x * cos + rotate_half(x) * sin, as three kernels: rotate_half(x) is x rolled by half a head
    with its first half negated, and the sign lives in sin_signed (computed once per forward).
    """
    cos, sin_signed = cos.unsqueeze(2), sin_signed.unsqueeze(2)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def rotary_qkv_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, heads: int, kv_heads: int,
    staging: Staging | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k/v product's output [B, T, heads + 2 kv_heads, D] -> queries and keys after RoPE and
    the values ([B, T, heads | kv_heads, D]; q and k views of one rotated tensor, v a view of qkv);
    with `staging`, the keys and values of token t (of the B x T) also written to row rows[t]."""
    qk = apply_rotary(qkv[:, :, : heads + kv_heads], cos, sin_signed)
    q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :]
    if staging is not None:
        keys, values, rows = staging
        keys.index_copy_(0, rows, k.reshape(-1, kv_heads, k.shape[-1]))
        values.index_copy_(0, rows, v.reshape(-1, kv_heads, v.shape[-1]))
    return q, k, v


def serves(head_dim: int) -> bool:
    return head_dim <= MAX_HEAD_DIM and head_dim == next_power_of_two(head_dim) and head_dim >= 2


@kernel
def _rotary_qkv(
    qkv_ptr, cos_ptr, sin_ptr, qk_ptr, keys_ptr, values_ptr, rows_ptr,
    tokens, rotated_heads, all_heads, first_key, first_value,
    qkv_token_stride, cos_token_stride, stage_row_stride,
    HALF: tl.constexpr, TOKEN_BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr, STAGE: tl.constexpr,
):
    # One program: TOKEN_BLOCK tokens x HEAD_BLOCK heads, each (token, head) a row of the tile.
    pair = tl.arange(0, TOKEN_BLOCK * HEAD_BLOCK)
    token = tl.program_id(0) * TOKEN_BLOCK + pair // HEAD_BLOCK
    head = tl.program_id(1) * HEAD_BLOCK + pair % HEAD_BLOCK
    low = tl.arange(0, HALF)[None, :]
    dim = 2 * HALF
    present = ((token < tokens) & (head < all_heads))[:, None]
    source = qkv_ptr + token[:, None] * qkv_token_stride + head[:, None] * dim + low
    x_low = tl.load(source, mask=present, other=0.0).to(tl.float32)
    x_high = tl.load(source + HALF, mask=present, other=0.0).to(tl.float32)
    angles = token[:, None] * cos_token_stride + low
    inside = token[:, None] < tokens
    cos_low = tl.load(cos_ptr + angles, mask=inside, other=0.0).to(tl.float32)
    cos_high = tl.load(cos_ptr + angles + HALF, mask=inside, other=0.0).to(tl.float32)
    sin_low = tl.load(sin_ptr + angles, mask=inside, other=0.0).to(tl.float32)  # negated (signed_sin)
    sin_high = tl.load(sin_ptr + angles + HALF, mask=inside, other=0.0).to(tl.float32)
    # rotate_half(x) = (-x_high, x_low); the minus sign lives in sin_low
    out_low = x_low * cos_low + x_high * sin_low
    out_high = x_high * cos_high + x_low * sin_high
    rotated = present & (head < rotated_heads)[:, None]
    target = qk_ptr + (token[:, None] * rotated_heads + head[:, None]) * dim + low
    tl.store(target, out_low.to(qk_ptr.dtype.element_ty), mask=rotated)
    tl.store(target + HALF, out_high.to(qk_ptr.dtype.element_ty), mask=rotated)
    if STAGE:
        row = tl.load(rows_ptr + token, mask=token < tokens, other=0)[:, None]
        is_key = rotated & (head >= first_key)[:, None]
        key_at = keys_ptr + row * stage_row_stride + (head - first_key)[:, None] * dim + low
        tl.store(key_at, out_low.to(keys_ptr.dtype.element_ty), mask=is_key)
        tl.store(key_at + HALF, out_high.to(keys_ptr.dtype.element_ty), mask=is_key)
        is_value = present & (head >= first_value)[:, None]
        value_at = values_ptr + row * stage_row_stride + (head - first_value)[:, None] * dim + low
        tl.store(value_at, x_low.to(values_ptr.dtype.element_ty), mask=is_value)
        tl.store(value_at + HALF, x_high.to(values_ptr.dtype.element_ty), mask=is_value)


def rotary_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, heads: int, kv_heads: int,
    staging: Staging | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rotary_qkv_reference as one Triton kernel (same outputs and layouts)."""
    batch, length, all_heads, dim = qkv.shape
    tokens, rotated_heads = batch * length, heads + kv_heads
    flat = qkv.reshape(tokens, all_heads, dim)
    if flat.stride(2) != 1 or flat.stride(1) != dim:
        flat = flat.contiguous()
    cos_flat, sin_flat = _angles(cos, tokens, dim), _angles(sin_signed, tokens, dim)
    if cos_flat.stride(0) != sin_flat.stride(0):
        cos_flat, sin_flat = cos_flat.contiguous(), sin_flat.contiguous()
    qk = torch.empty((batch, length, rotated_heads, dim), dtype=qkv.dtype, device=qkv.device)
    keys = values = rows = qk  # placeholders when nothing is staged (never written)
    stride = 0
    if staging is not None:
        keys, values, rows = staging
        if keys.stride()[1:] != (dim, 1) or values.stride() != keys.stride():
            raise ValueError("rotary_qkv: the staging keys and values must be [S, kv_heads, D] with rows "
                             "of one stride")
        stride = keys.stride(0)
    if tokens:
        head_block = min(HEAD_BLOCK, next_power_of_two(all_heads))
        token_block = max(1, TILE_ROWS // head_block)
        _rotary_qkv[(cdiv(tokens, token_block), cdiv(all_heads, head_block))](
            flat, cos_flat, sin_flat, qk, keys, values, rows,
            tokens, rotated_heads, all_heads, heads, rotated_heads,
            flat.stride(0), cos_flat.stride(0), stride,
            HALF=dim // 2, TOKEN_BLOCK=token_block, HEAD_BLOCK=head_block, STAGE=staging is not None,
        )
    v = qkv[:, :, rotated_heads:]
    return qk[:, :, :heads], qk[:, :, heads:], v


def _angles(table: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """A [B, T, D] cos or sin table as [B x T, D] rows with unit stride along D."""
    flat = table.reshape(-1, dim)
    if flat.shape[0] != tokens:
        raise ValueError(f"rotary_qkv: {flat.shape[0]} rows of angles for {tokens} tokens")
    return flat if flat.stride(1) == 1 else flat.contiguous()

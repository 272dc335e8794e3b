"""GGUF weights as com.microsoft.MatMulNBits blocks: 4- or 8-bit codes along K, a scale per block.

The op's layout (onnxruntime's contrib schema): `B` uint8 [N, K/block, block*bits/8], element 2i
of a block in the low nibble of byte i and 2i+1 in the high one (4 bits); `scales` float32
[N * K/block]; optional `zero_points` uint8 [N, ceil(K/block * bits/8)], packed the same way;
a weight is (code - zero point) * scale, the zero point defaulting to 2^(bits-1).

How GGUF types map (`layout_for`), for 4 or 8 bits:
- Q4_0 (value d*(q-8)) is exactly bits=4, block 32, no zero points: only the nibbles move (GGUF
  keeps elements j and j+16 in one byte).
- Q8_0 (value d*q, q int8) is exactly bits=8, block 32, no zero points: code q+128.
- Everything else (Q4_1, Q5_*, K-quants, floats) is dequantized by gguf's reference and
  re-quantized to blocks of 32 with uint8 zero points. Q4_1 would map exactly onto 4 bits with a
  *float* zero point (-m/d), but onnxruntime's CPU kernel runs float zero points 20-30x slower than
  uint8 ones or none (research notes §3.1; 8 ms vs 0.06-0.15 ms for 576x3072 here), so it pays one
  more rounding instead: up to half a 4-bit step at 4 bits (SmolLM2 Q4_1: relative RMS error 0.09,
  greedy answers equal to llama.cpp's on 1 of 8 prompts), 1/34 of one at 8 bits (8 of 8 with exact
  float activations).

ACCURACY_LEVEL 4 lets the CPU kernel quantize the activations to int8 per block (as llama.cpp does
to Q8_1 against its quantized weights) and use integer dot products. Measured here (2 threads,
576x3072, one row): 4-bit 0.06 ms vs 0.19 ms with float activations, fp32 MatMul 0.33-0.37 ms; 8-bit
has no fast float path at all (7.5 ms). The cost: SmolLM2 8-bit greedy answers equal llama.cpp's
on 6 of 8 prompts instead of 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

BLOCK = 32  # GGUF's own block: Q4_0/Q8_0 map without re-cutting; see `requantize` for the choice
_Q4_0_BYTES, _Q8_0_BYTES = 18, 34  # per block of 32: an f16 scale, then the codes
ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class Layout:
    """What a packed weight looks like, known from the GGUF's tensor types alone (no dequantizing)."""

    bits: int
    block: int
    zero_points: bool
    source: str  # "Q4_0" / "Q8_0": codes copied exactly; "requantized": rounded again

    def describe(self) -> str:
        """For localserve-onnx.json: '4-bit blocks of 32, uint8 zero points, re-quantized'."""
        how = "re-quantized" if self.source == "requantized" else f"{self.source}'s own codes"
        return f"{self.bits}-bit blocks of {self.block}{', uint8 zero points' if self.zero_points else ''}, {how}"

    def attrs(self, k: int, n: int) -> dict[str, int]:
        """MatMulNBits' attributes for a [K -> N] weight."""
        return {"K": k, "N": n, "bits": self.bits, "block_size": self.block, "accuracy_level": ACCURACY_LEVEL}


@dataclass(frozen=True)
class Packed:
    """One weight's MatMulNBits inputs."""

    layout: Layout
    codes: np.ndarray  # uint8 [N, K/block, block*bits/8]
    scales: np.ndarray  # float32 [N * K/block]
    zero_points: np.ndarray | None  # uint8 [N, ceil(K/block*bits/8)], None: the default zero point

    def dequantize(self, k: int) -> np.ndarray:
        """The float32 [N, K] matrix these blocks stand for (what the op multiplies by)."""
        bits, n = self.layout.bits, self.codes.shape[0]
        q = _unpack(self.codes, bits).astype(np.float32)  # [N, nb, block]
        nb = q.shape[1]
        if self.zero_points is None:
            zp = np.float32(1 << (bits - 1))
        else:
            zp = _unpack(self.zero_points[:, None, :], bits).reshape(n, -1)[:, :nb, None].astype(np.float32)
        w = (q - zp) * self.scales.reshape(n, nb, 1)
        return w.reshape(n, -1)[:, :k]


_EXACT = {4: "Q4_0", 8: "Q8_0"}  # the GGUF type whose codes each width holds as they are


def layout_for(types: Sequence[str], bits: int) -> Layout:
    """The `bits`-wide layout of the weight made of GGUF tensors of `types` (stacked along N):
    the exact mapping when every part has it, else re-quantized."""
    if set(types) == {_EXACT[bits]}:
        return Layout(bits, BLOCK, False, _EXACT[bits])
    return Layout(bits, BLOCK, True, "requantized")


def pack(tensors: Sequence, bits: int, dequantize) -> Packed:
    """GGUF tensors (numpy [out, in] once dequantized), stacked along N, as `bits`-wide MatMulNBits
    blocks. `dequantize(tensor)` gives a tensor's float32 [out, in] (only called when re-quantizing)."""
    layout = layout_for([t.tensor_type.name for t in tensors], bits)
    if layout.source == "Q4_0":
        return _pack_q4_0(np.concatenate([_raw(t) for t in tensors]), layout)
    if layout.source == "Q8_0":
        return _pack_q8_0(np.concatenate([_raw(t) for t in tensors]), layout)
    return requantize(np.concatenate([dequantize(t) for t in tensors]), layout)


def requantize(w: np.ndarray, layout: Layout) -> Packed:
    """Round [N, K] float weights to asymmetric blocks (round to nearest; each block's range is
    widened to hold 0, so the zero point is a code and a zero weight stays exactly zero)."""
    bits, block = layout.bits, layout.block
    qmax = (1 << bits) - 1
    n, k = w.shape
    pad = -k % block
    blocks = np.pad(w.astype(np.float32), ((0, 0), (0, pad))).reshape(n, -1, block)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scale = (hi - lo) / qmax
    scale[scale == 0] = 1.0  # an all-zero block: any scale, codes all equal the zero point
    zp = np.clip(np.rint(-lo / scale), 0, qmax)
    q = np.clip(np.rint(blocks / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    nb = blocks.shape[1]
    zp_codes = np.pad(zp.astype(np.uint8), ((0, 0), (0, -nb % (8 // bits))))
    return Packed(layout, _pack_codes(q, bits), scale.astype(np.float32).ravel(),
                  _pack_codes(zp_codes[:, None, :], bits)[:, 0, :])


def _raw(tensor) -> np.ndarray:
    """A quantized GGUF tensor's bytes as [rows, bytes per row] (the reader's own shape)."""
    return np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[-1]), -1)


def _pack_q4_0(raw: np.ndarray, layout: Layout) -> Packed:
    blocks = raw.reshape(raw.shape[0], -1, _Q4_0_BYTES)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32).ravel()
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # GGUF: byte j holds elements j and j+16
    return Packed(layout, _pack_codes(q, 4), scales, None)


def _pack_q8_0(raw: np.ndarray, layout: Layout) -> Packed:
    blocks = raw.reshape(raw.shape[0], -1, _Q8_0_BYTES)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32).ravel()
    q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Packed(layout, np.ascontiguousarray(q), scales, None)


def _pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """[N, nb, block] codes -> [N, nb, block*bits/8] bytes (4 bits: element 2i low, 2i+1 high)."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4), dtype=np.uint8)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out

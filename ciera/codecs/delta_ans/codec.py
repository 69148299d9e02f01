"""``delta_ans``: delta's symbols entropy-coded with interleaved rANS, in the previous exponent's context.

Every value's bit pattern is read as an unsigned ``W``-bit integer (``W`` = 16 for bf16/fp16, 32
for fp32) and the sender sends ``z = zigzag((new - previous) mod 2^W)``, exactly as ``delta``
(:mod:`ciera.codecs.delta`): integer arithmetic, so NaN payloads, infinities, signed zeros and
subnormals round-trip bit for bit. ``delta`` packs ``z`` at a width per previous exponent; here
``z`` is split into a symbol, coded with a frequency table of that exponent (the context), and
raw bits:

    z < 16     symbol z, no raw bits
    z >= 16    symbol 11 + bit_length(z) (16 .. W + 11), then the k = bit_length(z) - 1 bits
               below the leading one, raw

``A = W + 12`` symbols. Small changes (the bulk of an AdamW step: unchanged or a few ulps) get
their exact probability; large ones cost their class's probability plus their low bits. On
``AdamTrajectory(numel=2**18, dtype=bf16)`` after 30 warmup steps the empirical cost of this split
is 1.81 bits per value at lr 1e-4 against an order-0 entropy of ``z`` given the previous exponent of
1.79 bits (2.97 against 2.92 at lr 3e-4); classes from bit length 0 (no direct symbols) cost 1.95
and 3.13.

**Coder.** rANS with a 32-bit state ``x`` in ``[2^16, 2^32)``, 16-bit renormalisation words and
frequencies quantised to a total of ``2^12`` (``P = 12``), as DietGPU's ANS. Encoding a symbol of
frequency ``f`` and cumulative frequency ``c``: when ``x >= f << 20`` emit ``x & 0xFFFF`` and
``x >>= 16``; then ``x = (x // f) << 12 | x % f + c``. Raw bits go through the same state in
chunks of ``k <= 16`` bits: when ``x >= 2^(32 - k)`` emit a word and shift, then
``x = x << k | bits``. Each step emits at most one word. The decoder mirrors it: ``slot = x & 4095``
gives the symbol, ``x = f * (x >> 12) + slot - c``; a raw chunk is ``x & (2^k - 1)``, ``x >>= k``;
after each, when ``x < 2^16``, ``x = x << 16 | next word``. A value's symbol is decoded first,
then its low 16 raw bits, then (fp32 only) the rest; the encoder runs backwards.

**Streams.** Values form blocks of ``B = block_size`` values (``B = 32 L``); value ``t`` of a block
belongs to lane ``t % 32`` at step ``t // 32``, so each block is 32 independent streams of up to
``L`` steps (a GPU warp decodes a block, one lane per stream, reading 32 consecutive values per
step; the C twin interleaves the 32 states). Streams are numbered block-major (``32 b + lane``).

**Layout.** Payload sections after the 32-byte header::

    map     2^exp_bits / 8 bytes                 bit e (LSB first): context e has a table
    tables  16-aligned, T x A x 2 bytes          per mapped context (ascending): A uint16 frequencies
                                                 summing to 2^12 (T = contexts in the map)
    counts  16-aligned, 32 n_blocks x 2 bytes    per stream: 16-bit words it holds, or 0xFFFF in every
                                                 stream of a raw block
    data    16-aligned, blocks back to back, 2-byte granular
              ANS block  per stream with values: final state (4 bytes), then its words in
                         reading order (2 bytes each), little endian
              raw block  z of every value (``S`` = bytes of one value each) in value order

Offsets are prefix sums of sizes the decoder reads from the counts (a GPU computes them with a
scan, no host read). A context is mapped when a value of the shard has that previous exponent.
A block whose ANS streams would exceed its raw size is sent raw, and when the tables make the
payload larger than ``max_bytes`` = (the fixed part with no tables) + raw bytes, the whole shard
is sent raw with an empty map, so ``max_bytes`` is an honest bound. A payload that does not fit
its capacity writes nothing but the header (overflow, with the bytes it needs). The decoder
checks that every table sums to ``2^12``, every ANS stream ends exactly at its last word with the
initial state ``2^16``, and every section lies inside the payload: a corrupt payload is an
error, never a silent decode past it.

Frequencies: ``f_s = floor(n_s 2^12 / N)``, raised to 1 for every symbol that occurs, the
difference to ``2^12`` added to (or taken from) the most frequent symbol (the first of equals).

Why ``L = 1024`` (``B = 32768``) by default: a stream's fixed cost is its 4-byte state and 2-byte
count, 48 / L bits per value: 0.05 at L = 1024, 0.19 at L = 256 (about 1% of raw bf16). Longer
streams leave fewer independent lanes per shard (a GPU wants thousands); the cost model weighs
the codec's measured speed.

Sender state: a copy of the previous bit patterns (the receivers' ``target``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import HEADER_BYTES, align_up, decode_many_of
from ..formats import from_unsigned, to_unsigned
from ..patterns import DeltaShapeLayout, PatternStateCodec, bit_length, exponent_of, unzigzag_add, zigzag
from ..registry import CodecSpec, register_codec

LANES = 32
"""Streams per block: one warp's lanes."""
PROB_BITS = 12
"""Frequencies of a table sum to ``2^PROB_BITS``."""
DIRECT = 16
"""``z`` below this is its own symbol."""
STATE_LOW = 1 << 16
"""The state lies in ``[STATE_LOW, 2^32)``; encoders start from it, decoders must end on it."""
RAW_MARK = 0xFFFF
"""Count of every stream of a raw block."""


@dataclass(frozen=True)
class DeltaAnsLayout(DeltaShapeLayout):
    """Sections, stream structure and alphabet of a delta_ans payload for one shard shape."""

    @property
    def lanes(self) -> int:
        return LANES

    @property
    def steps(self) -> int:
        """``L``: most values of one stream."""
        return self.block_size // LANES

    @property
    def n_streams(self) -> int:
        return self.n_blocks * LANES

    @property
    def n_symbols(self) -> int:
        """``A``: 16 direct symbols and the bit-length classes 5..W."""
        return self.width + DIRECT - 4

    @property
    def prob_bits(self) -> int:
        return PROB_BITS

    @property
    def max_words(self) -> int:
        """Most words one stream can hold: one per symbol and per raw chunk of 16 bits."""
        return self.steps * (1 + -(-(self.width - 1) // 16))

    @property
    def off_map(self) -> int:
        return HEADER_BYTES

    @property
    def map_bytes(self) -> int:
        return self.n_classes // 8

    @property
    def off_tables(self) -> int:
        return align_up(self.off_map + self.map_bytes)

    @property
    def table_bytes(self) -> int:
        return 2 * self.n_symbols

    def off_counts(self, n_tables: int) -> int:
        return align_up(self.off_tables + n_tables * self.table_bytes)

    def off_data(self, n_tables: int) -> int:
        return align_up(self.off_counts(n_tables) + 2 * self.n_streams)

    def streams(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """Per-value ``[numel]`` -> ``[L, n_streams]`` (step-major; padding ``fill``)."""
        pad = self.n_blocks * self.block_size - self.numel
        if pad:
            x = torch.cat([x, x.new_full((pad,), fill)])
        return x.view(self.n_blocks, self.steps, LANES).permute(1, 0, 2).reshape(self.steps, self.n_streams)

    def lane_values(self, device) -> torch.Tensor:
        """Values of every stream, ``[n_streams]`` int64."""
        b = torch.arange(self.n_blocks, device=device, dtype=torch.int64)
        in_block = (self.numel - b * self.block_size).clamp(max=self.block_size)
        lane = torch.arange(LANES, device=device, dtype=torch.int64)
        return ((in_block[:, None] - lane + LANES - 1) // LANES).clamp(min=0).reshape(-1)

    def block_values(self, device) -> torch.Tensor:
        """Values of every block, ``[n_blocks]`` int64."""
        b = torch.arange(self.n_blocks, device=device, dtype=torch.int64)
        return (self.numel - b * self.block_size).clamp(max=self.block_size)


# -- pieces shared by the reference and the twins' tests ---------------------------------------
def symbols(layout: DeltaAnsLayout, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, raw bit count k) of every ``z`` (int64)."""
    bl = bit_length(z, layout.width)
    direct = z < DIRECT
    return torch.where(direct, z, bl + (DIRECT - 5)), torch.where(direct, 0, bl - 1)


def quantize(counts: torch.Tensor) -> torch.Tensor:
    """Frequencies summing to ``2^12`` from ``[T, A]`` counts (every row with a count), int64."""
    M = 1 << PROB_BITS
    counts = counts.to(torch.int64)
    f = counts * M // counts.sum(1, keepdim=True)
    f = torch.where((counts > 0) & (f == 0), 1, f)
    top = counts.argmax(1)  # the first of equals
    rows = torch.arange(f.shape[0], device=f.device)
    f[rows, top] += M - f.sum(1)
    return f


def _le(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    shifts = 8 * torch.arange(nbytes, dtype=torch.int64, device=x.device)
    return ((x.to(torch.int64)[..., None] >> shifts) & 0xFF).to(torch.uint8)


def _from_le(b: torch.Tensor) -> torch.Tensor:
    shifts = 8 * torch.arange(b.shape[-1], dtype=torch.int64, device=b.device)
    return (b.to(torch.int64) << shifts).sum(-1)


def _corrupt(what: str) -> ValueError:
    return ValueError(f"delta_ans: corrupt payload: {what}")


# -- reference ---------------------------------------------------------------------------------
def encode_reference(*, layout: DeltaAnsLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """Pure-torch encoder: writes every section of ``out`` but the header when the payload fits
    (nothing otherwise), updates ``state`` and returns the bytes needed (0-d int64 on ``out``'s
    device)."""
    n, W, A, S = layout.numel, layout.width, layout.n_symbols, layout.high_bytes
    dev = out.device
    if n == 0:
        return torch.tensor(layout.off_data(0), dtype=torch.int64, device=dev)
    u_old = to_unsigned(state).to(torch.int64)
    z = zigzag(layout.fmt, to_unsigned(shard_bits).to(torch.int64), u_old)
    ctx = exponent_of(layout.fmt, u_old)
    sym, k = symbols(layout, z)
    counts = torch.bincount(ctx * A + sym, minlength=layout.n_classes * A).view(layout.n_classes, A)
    mapped = counts.sum(1) > 0
    n_tab = int(mapped.sum())
    freq = quantize(counts[mapped])
    cum = torch.cumsum(freq, 1) - freq
    tab_of = torch.cumsum(mapped.to(torch.int64), 0) - 1

    # rANS over [L, streams], backwards; every step may emit one word per chunk (3 per value).
    nvals = layout.lane_values(dev)
    sym_s, k_s, z_s = layout.streams(sym), layout.streams(k), layout.streams(z)
    tab_s = layout.streams(tab_of[ctx])
    valid = torch.arange(layout.steps, device=dev)[:, None] < nvals[None, :]
    x = torch.full((layout.n_streams,), STATE_LOW, dtype=torch.int64, device=dev)
    words, emitted = [], []

    def put(active, bits, nb):
        nonlocal x
        renorm = active & ((x >> (32 - nb)) > 0)  # x >= 2^(32 - nb): the shifted state would not fit
        words.append(x & 0xFFFF)
        emitted.append(renorm)
        x = torch.where(renorm, x >> 16, x)
        x = torch.where(active, (x << nb) | bits, x)

    for t in range(min(layout.steps, -(-n // LANES)) - 1, -1, -1):  # steps past the longest stream: none
        v, kt, zt = valid[t], k_s[t], z_s[t]
        low = zt & ((1 << kt) - 1)
        hi_n = (kt - 16).clamp(min=0)
        put(v & (hi_n > 0), low >> 16, hi_n)
        lo_n = kt.clamp(max=16)
        put(v & (lo_n > 0), low & 0xFFFF, lo_n)
        f = torch.where(v, freq[tab_s[t], sym_s[t]], 1)
        c = torch.where(v, cum[tab_s[t], sym_s[t]], 0)
        renorm = v & (x >= f << (32 - PROB_BITS))
        words.append(x & 0xFFFF)
        emitted.append(renorm)
        x = torch.where(renorm, x >> 16, x)
        x = torch.where(v, ((x // f) << PROB_BITS) + x % f + c, x)

    words, emitted = torch.stack(words), torch.stack(emitted)  # [events, streams], emission order
    n_words = emitted.sum(0)
    stream_bytes = torch.where(nvals > 0, 4 + 2 * n_words, 0)
    block_vals = layout.block_values(dev)
    ans_bytes = stream_bytes.view(layout.n_blocks, LANES).sum(1)
    raw = ans_bytes > block_vals * S
    block_bytes = torch.where(raw, block_vals * S, ans_bytes)
    needed = layout.off_data(n_tab) + int(block_bytes.sum())
    max_bytes = layout.off_data(0) + n * S
    if needed > max_bytes:  # the tables cost more than the streams save: the whole shard raw
        n_tab, raw, block_bytes, needed = 0, torch.ones_like(raw), block_vals * S, max_bytes
    state.copy_(shard_bits)
    if needed > out.numel():
        return torch.tensor(needed, dtype=torch.int64, device=dev)

    buf = torch.zeros(needed, dtype=torch.uint8, device=dev)
    if n_tab:
        bits = mapped.to(torch.int64).view(-1, 8) << torch.arange(8, device=dev)
        buf[layout.off_map : layout.off_map + layout.map_bytes] = bits.sum(1).to(torch.uint8)
        buf[layout.off_tables : layout.off_tables + n_tab * layout.table_bytes] = _le(freq, 2).reshape(-1)
    raw_s = raw.repeat_interleave(LANES)
    cnt = torch.where(raw_s, RAW_MARK, n_words)
    off_c = layout.off_counts(n_tab)
    buf[off_c : off_c + 2 * layout.n_streams] = _le(cnt, 2).reshape(-1)
    block_start = layout.off_data(n_tab) + torch.cumsum(block_bytes, 0) - block_bytes
    stream_start = (block_start.repeat_interleave(LANES)
                    + (torch.cumsum(stream_bytes.view(-1, LANES), 1) - stream_bytes.view(-1, LANES)).reshape(-1))
    ans = (~raw_s) & (nvals > 0)
    at = stream_start[ans, None] + torch.arange(4, device=dev)
    buf[at.reshape(-1)] = _le(x[ans], 4).reshape(-1)
    # The r-th word a stream emitted lies at position count - 1 - r of its words.
    rank = torch.cumsum(emitted.to(torch.int64), 0) - 1
    keep = emitted & ans[None, :]
    e_idx, s_idx = torch.nonzero(keep, as_tuple=True)
    pos = stream_start[s_idx] + 4 + 2 * (n_words[s_idx] - 1 - rank[e_idx, s_idx])
    w = words[e_idx, s_idx]
    buf[pos] = (w & 0xFF).to(torch.uint8)
    buf[pos + 1] = (w >> 8).to(torch.uint8)
    if bool(raw.any()):
        vb = torch.arange(n, device=dev) // layout.block_size
        sel = raw[vb]
        at = (block_start[vb] + (torch.arange(n, device=dev) % layout.block_size) * S)[sel, None] + torch.arange(S, device=dev)
        buf[at.reshape(-1)] = _le(z[sel], S).reshape(-1)
    out[HEADER_BYTES:needed] = buf[HEADER_BYTES:]
    return torch.tensor(needed, dtype=torch.int64, device=dev)


def decode_reference(*, layout: DeltaAnsLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Pure-torch decoder: ``target_bits`` (previous values) becomes the encoded shard."""
    n, A, S, M = layout.numel, layout.n_symbols, layout.high_bytes, 1 << PROB_BITS
    if n == 0:
        return
    dev = payload.device
    length = payload.numel()
    if length < layout.off_data(0):
        raise _corrupt("a section runs past the payload's end")
    mbytes = payload[layout.off_map : layout.off_map + layout.map_bytes].to(torch.int64)
    mapped = ((mbytes[:, None] >> torch.arange(8, device=dev)) & 1).reshape(-1).bool()
    n_tab = int(mapped.sum())
    if layout.off_data(n_tab) > length:
        raise _corrupt("a section runs past the payload's end")
    freq = _from_le(payload[layout.off_tables : layout.off_tables + n_tab * layout.table_bytes].view(n_tab, A, 2))
    if n_tab and bool((freq.sum(1) != M).any()):
        raise _corrupt("a frequency table does not sum to 2^12")
    cum = torch.cumsum(freq, 1) - freq
    cum_end = torch.cumsum(freq, 1)
    tab_of = torch.where(mapped, torch.cumsum(mapped.to(torch.int64), 0) - 1, -1)
    off_c = layout.off_counts(n_tab)
    cnt = _from_le(payload[off_c : off_c + 2 * layout.n_streams].view(-1, 2))
    raw_s = cnt == RAW_MARK
    raw = raw_s.view(-1, LANES)[:, 0]
    if bool((raw_s.view(-1, LANES).any(1) != raw).any()):
        raise _corrupt("a raw block's streams are not all marked raw")
    if bool((~raw_s & (cnt > layout.max_words)).any()):
        raise _corrupt("a stream holds more words than its values can emit")
    nvals = layout.lane_values(dev)
    block_vals = layout.block_values(dev)
    stream_bytes = torch.where(raw_s | (nvals == 0), 0, 4 + 2 * cnt)
    ans_bytes = stream_bytes.view(-1, LANES).sum(1)
    block_bytes = torch.where(raw, block_vals * S, ans_bytes)
    block_start = layout.off_data(n_tab) + torch.cumsum(block_bytes, 0) - block_bytes
    if layout.off_data(n_tab) + int(block_bytes.sum()) > length:
        raise _corrupt("a section runs past the payload's end")
    stream_start = (block_start.repeat_interleave(LANES)
                    + (torch.cumsum(stream_bytes.view(-1, LANES), 1) - stream_bytes.view(-1, LANES)).reshape(-1))

    u_old = to_unsigned(target_bits).to(torch.int64)
    z = torch.zeros(n, dtype=torch.int64, device=dev)
    if bool(raw.any()):
        vb = torch.arange(n, device=dev) // layout.block_size
        sel = raw[vb]
        at = (block_start[vb] + (torch.arange(n, device=dev) % layout.block_size) * S)[sel, None] + torch.arange(S, device=dev)
        z[sel] = _from_le(payload[at])

    ans = (~raw_s) & (nvals > 0)
    if bool(ans.any()):
        last = length - 1
        ctx_s = layout.streams(tab_of[exponent_of(layout.fmt, u_old)], fill=-1)
        valid = (torch.arange(layout.steps, device=dev)[:, None] < nvals[None, :]) & ans[None, :]
        if bool((valid & (ctx_s < 0)).any()):
            raise _corrupt("a value's context has no table")
        word_at = stream_start + 4
        x = torch.where(ans, _from_le(payload[(stream_start[:, None] + torch.arange(4, device=dev)).clamp(max=last)]), 0)
        end = stream_start + 4 + 2 * cnt
        zs = torch.zeros(layout.steps, layout.n_streams, dtype=torch.int64, device=dev)

        def refill(active):
            nonlocal x, word_at
            need = active & (x < STATE_LOW)
            w = payload[word_at.clamp(max=last)].to(torch.int64) | payload[(word_at + 1).clamp(max=last)].to(torch.int64) << 8
            x = torch.where(need, (x << 16) | w, x)
            word_at = word_at + 2 * need

        for t in range(min(layout.steps, -(-n // LANES))):
            v = valid[t]
            ti = ctx_s[t].clamp(min=0)
            slot = x & (M - 1)
            s = torch.searchsorted(cum_end[ti], slot[:, None], right=True).squeeze(1).clamp(max=A - 1)
            f, c = freq[ti, s], cum[ti, s]
            x = torch.where(v, f * (x >> PROB_BITS) + slot - c, x)
            refill(v)
            k = torch.where(s >= DIRECT, s - (DIRECT - 4), 0)
            lo_n = k.clamp(max=16)
            lo = x & ((1 << lo_n) - 1)
            x = torch.where(v, x >> lo_n, x)
            refill(v & (lo_n > 0))
            hi_n = (k - 16).clamp(min=0)
            hi = x & ((1 << hi_n) - 1)
            x = torch.where(v, x >> hi_n, x)
            refill(v & (hi_n > 0))
            zs[t] = torch.where(s < DIRECT, s, (1 << k) | (hi << 16) | lo)
            if bool((v & (word_at > end)).any()):
                raise _corrupt("a stream reads past its words")
        if bool((ans & ((word_at != end) | (x != STATE_LOW))).any()):
            raise _corrupt("a stream does not end on its last word and initial state")
        zs = zs.view(layout.steps, layout.n_blocks, LANES).permute(1, 0, 2).reshape(-1)[:n]
        vb = torch.arange(n, device=dev) // layout.block_size
        z = torch.where(raw[vb], z, zs)
    target_bits.copy_(from_unsigned(unzigzag_add(layout.fmt, u_old, z), target_bits.dtype))


decode_many_reference = decode_many_of(decode_reference)
"""Pure-torch batched decoder (see Codec.decode_many): :func:`decode_reference` per payload."""


@register_codec
class DeltaAnsCodec(PatternStateCodec):
    """Temporal delta, entropy-coded (interleaved rANS) in the context of each value's previous
    exponent; raw blocks as the escape. State: previous bit patterns."""

    spec = CodecSpec(
        name="delta_ans", codec_id=3, reads_previous="values", auto=True, block_size_option=None,
        native="ciera.codecs.delta_ans.native", kernels="ciera.codecs.delta_ans.kernels",
        summary="delta's changes entropy-coded (interleaved rANS): fewest bytes, slowest")
    encode_reference = staticmethod(encode_reference)
    decode_reference = staticmethod(decode_reference)
    decode_many_reference = staticmethod(decode_many_reference)

    def __init__(self, *, dtype: torch.dtype, numel: int, backend: str = "auto", block_size: int = 32768):
        super().__init__(dtype=dtype, numel=numel, backend=backend)
        if not 64 <= block_size <= 1 << 19 or block_size & (block_size - 1):
            raise ValueError(f"delta_ans: block_size={block_size} must be a power of two in [64, 2^19] "
                             f"(32 lanes x 2..16384 steps)")
        self.block_size = block_size
        self.layout = DeltaAnsLayout(self.fmt, numel, block_size)

    @property
    def fixed_bytes(self) -> int:
        return self.layout.off_data(0)

    @property
    def max_bytes(self) -> int:
        return self.layout.off_data(0) + self.raw_bytes


__all__ = [
    "DIRECT", "LANES", "PROB_BITS", "RAW_MARK", "STATE_LOW", "DeltaAnsCodec", "DeltaAnsLayout",
    "decode_many_reference", "decode_reference", "encode_reference", "quantize", "symbols",
]

"""Frame bytes -> pixels, safely: the size of what will be decoded is known and bounded before any pixel is.

A JPEG is walked marker by marker first (Python, numpy over a large file's scans; no pixel work): its SOF
dimensions must equal the frame header and stay within `max_pixels`, it must be one complete baseline or
progressive Huffman-coded image ending in EOI, with no stray bytes between its segments, and each scan must hold
at least the bits its blocks need. Only then does libjpeg-turbo (strict) decode it. This catches what libjpeg lets
through silently: a few-hundred-byte JPEG whose SOF declares 12000x12000 (a decompression bomb), and data cut
short with an EOI marker after it, which libjpeg pads with grey and decodes without an error. Pillow's
`LOAD_TRUNCATED_IMAGES` is never set here; data cut without an EOI fails both here and in Pillow. `check_frame`
makes every check before decoding, for the device data path (`devicepath`), whose decoders are not strict.
A camera repeats its header (tables, frame header, scan header) on every frame: a header walked once is kept by its
bytes (`HEADERS`), and the next frame that starts with the same bytes is walked only from its scan data on.
"""

from __future__ import annotations

import io
import re
import struct
import threading
from dataclasses import dataclass, field

import numpy as np
import simplejpeg
from PIL import Image

from worker.config import MAX_FRAME_PIXELS_CEILING
from worker.errors import StreamferError
from worker.frames import Encoding, Frame


class FrameDecodeError(StreamferError):
    """One frame's pixels are unusable (corrupt JPEG, wrong byte count, zero or mismatched dimensions)."""


def decode_pixels(frame: Frame, channels: int = 3, max_pixels: int = MAX_FRAME_PIXELS_CEILING,
                 min_hw: tuple[int, int] | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The frame's pixels as a (height, width, channels) uint8 array, or FrameDecodeError saying why not.

    `max_pixels` is `limits.max_frame_pixels`; the message decoder has already held the frame header to it,
    and a JPEG must match its header, so the default (the setting's ceiling) is only a last line of defence.
    With `min_hw` a JPEG may come back smaller than the frame, scaled by 1/2, 1/4 or 1/8 (`jpeg_scale`) but
    never below `min_hw`: libjpeg's scaled IDCT then skips most of the pixel work. Raw frames are full size.
    A JPEG whose decoded pixels are exactly the shape of `out` (a C-contiguous uint8 batch row) is decoded into
    it, which is then returned: no array of its own, no copy. On an error `out` may hold part of the frame.
    """
    info = check_frame(frame, max_pixels)  # raises FrameDecodeError before any pixel work
    if info is None:
        return _decode_raw(frame, channels)
    return _decode_jpeg(frame, info, channels, jpeg_scale((frame.height, frame.width), min_hw), out)


def check_frame(frame: Frame, max_pixels: int = MAX_FRAME_PIXELS_CEILING) -> JpegInfo | None:
    """Every check `decode_pixels` makes before decoding a pixel, for a decoder elsewhere (the device data path):
    dimensions, the pixel limit, a RAW_RGB8 frame's byte count, a JPEG's structure walk against its frame header
    and its components. Returns the JPEG's `JpegInfo` (None for a RAW_RGB8 frame) or raises FrameDecodeError."""
    h, w, c = frame.shape
    if h <= 0 or w <= 0 or c <= 0:
        raise FrameDecodeError(f"frame declares {w}x{h}x{c} pixels (width x height x channels); all must be > 0")
    if w * h > max_pixels:
        raise FrameDecodeError(f"frame {w}x{h} exceeds the {max_pixels}-pixel limit (limits.max_frame_pixels)")
    if frame.encoding is Encoding.RAW_RGB8:
        expected = h * w * c
        if len(frame.data) != expected:
            raise FrameDecodeError(f"RAW_RGB8 frame has {len(frame.data)} bytes, expected height*width*channels = "
                                   f"{h}*{w}*{c} = {expected}")
        return None
    if frame.encoding is Encoding.JPEG:
        return check_jpeg(frame.data, (w, h))
    raise FrameDecodeError(f"unsupported encoding {frame.encoding!r}")


def _decode_raw(frame: Frame, channels: int) -> np.ndarray:
    """A checked RAW_RGB8 frame's pixels: a read-only view of its message."""
    h, w, c = frame.shape
    if c != channels:
        raise FrameDecodeError(f"RAW_RGB8 frame has {c} channels; the model takes {channels}")
    return np.frombuffer(frame.data, dtype=np.uint8).reshape(h, w, c)


# libjpeg-turbo has SIMD IDCTs for these reductions; other M/8 scales (3/8, 5/8...) run in plain C, often
# slower than decoding at full size, so they are never used.
JPEG_SCALES = (8, 4, 2)


def jpeg_scale(frame_hw: tuple[int, int], min_hw: tuple[int, int] | None) -> int:
    """The largest reduction k in 8, 4, 2 whose scaled size ceil(h/k) x ceil(w/k) is still >= `min_hw`; 1 if none."""
    if min_hw is None:
        return 1
    h, w = frame_hw
    return next((k for k in JPEG_SCALES if -(-h // k) >= min_hw[0] and -(-w // k) >= min_hw[1]), 1)


def fitting_row(out: np.ndarray | None, hwc: tuple[int, ...]) -> np.ndarray | None:
    """`out` when it is a C-contiguous uint8 array of shape `hwc` (a batch row to write into), else None."""
    if out is not None and out.shape == hwc and out.dtype == np.uint8 and out.flags.c_contiguous:
        return out
    return None


def _decode_jpeg(frame: Frame, info: JpegInfo, channels: int, scale: int = 1,
                 out: np.ndarray | None = None) -> np.ndarray:
    try:
        # libjpeg-turbo with strict=True: its warnings are errors, so data cut short (even when closed with a
        # new EOI marker, which Pillow decodes as grey padding) never becomes a score.
        if info.components != 4:
            # min_height/min_width of exactly ceil(size/k) make libjpeg pick the scale 1/k (its sizes round up).
            hw = (-(-frame.height // scale), -(-frame.width // scale))
            row = fitting_row(out, (*hw, channels))
            arr = simplejpeg.decode_jpeg(frame.data, colorspace="RGB" if channels == 3 else "GRAY", strict=True,
                                         min_height=hw[0], min_width=hw[1], buffer=row)
            if row is not None:  # arr is a view of row
                if arr.shape[:2] != hw:
                    raise FrameDecodeError(f"JPEG decoded to {arr.shape[1]}x{arr.shape[0]} pixels at scale 1/{scale}, "
                                           f"not the {hw[1]}x{hw[0]} its header gives")
                return row
            return arr if arr.ndim == 3 else arr[:, :, None]
        # CMYK (print files, never video): libjpeg-turbo checks the data, Pillow converts the colours (it knows
        # Adobe's inverted CMYK); both decode, which only this rare kind pays for.
        simplejpeg.decode_jpeg(frame.data, colorspace="CMYK", strict=True)
        with Image.open(io.BytesIO(frame.data), formats=("JPEG",)) as img:
            arr = np.asarray(img.convert("RGB" if channels == 3 else "L"), dtype=np.uint8)
    except (ValueError, RuntimeError, OSError) as exc:
        raise FrameDecodeError(f"JPEG does not decode: {exc}") from None
    return arr if arr.ndim == 3 else arr[:, :, None]


# -- the JPEG structure walk --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JpegInfo:
    """What a JPEG declares, read from its markers without decoding: size, components, scans."""

    width: int
    height: int
    components: int
    progressive: bool
    scans: int


_SOI, _EOI, _SOS, _DNL, _DRI = 0xD8, 0xD9, 0xDA, 0xDC, 0xDD
_SUPPORTED_SOF = {0xC0: False, 0xC1: False, 0xC2: True}  # baseline, extended sequential, progressive (Huffman)
_OTHER_SOF = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# Codes that have no length and may not stand between segments: TEM, RST0..7, a second SOI, and 00 (stuffing).
_NO_LENGTH = frozenset({0x00, 0x01, _SOI, *range(0xD0, 0xD8)})


@dataclass
class _Component:
    ident: int
    h: int
    v: int
    blocks: int = 0  # 8x8 blocks of this component, before MCU padding (a lower bound of what a scan codes)
    # Per coefficient 0..63: the lowest successive-approximation bit coded so far (64 = never coded).
    lowest_bit: list[int] = field(default_factory=lambda: [64] * 64)


def _bad(reason: str) -> FrameDecodeError:
    return FrameDecodeError(f"JPEG does not decode: {reason}")


def check_jpeg(data: bytes, expected_size: tuple[int, int] | None = None) -> JpegInfo:
    """Walk the JPEG's markers; FrameDecodeError unless it is one complete, supported image (of
    `expected_size` = (width, height) when given, checked as soon as the frame header is read).
    Costs one bytes.find pass over the entropy-coded data: no Huffman decoding, no pixels. A header (every
    segment up to the first scan's) byte for byte equal to one walked before is not walked again (`HEADERS`).
    Last, libjpeg-turbo's own header read (`_libjpeg_reads_header`), once per header too."""
    if data[:2] != b"\xff\xd8":
        raise _bad("no SOI marker (FF D8) at the start: not a JPEG")
    n = len(data)
    vectorised = VECTOR_SCAN_MIN_BYTES <= n <= VECTOR_SCAN_MAX_BYTES
    ends: _ScanEnds | None = None  # built at the first scan: a frame refused by its header never pays for it
    known = HEADERS.lookup(data)
    first_scan: tuple[int, _Header] | None = None  # where a header not known yet ends, and what it holds
    if known is not None:
        header, pos = known
        if expected_size is not None and header.size != expected_size:
            raise _size_mismatch(header.size, expected_size)
        if vectorised:
            ends = _ScanEnds(data)
        if header.whole is not None:  # one sequential scan of every component: complete if EOI follows it
            stop = _scan_end(data, pos, header.restart_interval > 0, ends, 2, header.whole.blocks)
            if _next_marker(data, stop)[0] == _EOI:
                return header.whole.info
        size, progressive, restart_interval, comps = header.size, header.progressive, header.restart_interval, \
            header.components()
        pos = _read_scan(data, pos, header.scan, comps, progressive, restart_interval > 0, ends)
        scans = 1
    else:
        pos, comps, size, progressive, scans, restart_interval = 2, {}, None, False, 0, 0
    while True:
        marker, pos = _next_marker(data, pos)
        if marker is None:
            raise _bad("truncated: the data ends before the EOI marker (FF D9)")
        if marker == _EOI:
            break
        if marker in _NO_LENGTH:
            raise _bad(f"stray marker FF {marker:02X} outside a scan")
        if pos + 2 > n:
            raise _bad("truncated inside a marker segment")
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2 or pos + length > n:
            raise _bad(f"marker FF {marker:02X} segment of {length} bytes runs past the data")
        segment = data[pos + 2:pos + length]
        pos += length
        if marker in _SUPPORTED_SOF or marker in _OTHER_SOF:
            if marker in _OTHER_SOF:
                raise _bad(f"unsupported coding process (SOF FF {marker:02X}); "
                           f"send baseline or progressive Huffman-coded JPEG")
            if size is not None:
                raise _bad("more than one frame header (SOF)")
            progressive = _SUPPORTED_SOF[marker]
            size = _read_sof(segment, comps)
            if expected_size is not None and size != expected_size:
                raise _size_mismatch(size, expected_size)
        elif marker == _SOS:
            if size is None:
                raise _bad("a scan (SOS) before the frame header (SOF)")
            if scans == 0:  # everything before here was checked: the header, as the next frame may repeat it
                first_scan = (pos, _Header.at_first_scan(size, progressive, restart_interval, segment, comps))
            if vectorised and ends is None:
                ends = _ScanEnds(data)
            pos = _read_scan(data, pos, segment, comps, progressive, restart_interval > 0, ends)
            scans += 1
        elif marker == _DRI:
            if len(segment) < 2:
                raise _bad("restart interval segment (DRI) too short")
            (restart_interval,) = struct.unpack_from(">H", segment, 0)
        elif marker == _DNL:
            raise _bad("a DNL marker (height defined after the scan): unsupported")
    if size is None or scans == 0:
        raise _bad("no frame header (SOF) or no scan (SOS)")
    _check_complete(comps, progressive)
    if first_scan is not None:  # remembered only now: a hit stands for the walk and libjpeg's read of its bytes
        _libjpeg_reads_header(data)
        HEADERS.remember(data, *first_scan)
    return JpegInfo(width=size[0], height=size[1], components=len(comps), progressive=progressive, scans=scans)


def _libjpeg_reads_header(data: bytes) -> None:
    """libjpeg-turbo's own header read (1.5 us, up to the first scan: what a `HEADERS` key holds): both data paths
    refuse the headers it refuses (sampling factors its API cannot name), in its words."""
    try:
        simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError) as exc:
        raise FrameDecodeError(f"JPEG does not decode: {exc}") from None


def _size_mismatch(size: tuple[int, int], expected: tuple[int, int]) -> FrameDecodeError:
    return FrameDecodeError(f"JPEG decodes to {size[0]}x{size[1]}, but the frame declares {expected[0]}x{expected[1]} "
                            "(read from its header, before decoding)")


@dataclass(frozen=True)
class _Header:
    """What the walk knows at the end of a JPEG's first scan header (SOS segment): nothing in it depends on the
    bytes after, so a frame whose bytes up to there are the same resumes the walk from there."""

    size: tuple[int, int]
    progressive: bool
    restart_interval: int
    scan: bytes  # the first SOS segment's payload
    comps: tuple[tuple[int, int, int, int], ...]  # (ident, h, v, blocks) per component, in SOF order
    whole: _WholeScan | None  # the first scan codes the whole image (sequential, every component, a valid header)

    @classmethod
    def at_first_scan(cls, size: tuple[int, int], progressive: bool, restart_interval: int, scan: bytes,
                      comps: dict[int, _Component]) -> _Header:
        whole = None
        count = scan[0] if scan else 0
        idents = set(scan[1:1 + 2 * count:2])
        if (not progressive and len(scan) >= 1 + 2 * count + 3 and idents == set(comps) and count == len(comps)
                and tuple(scan[1 + 2 * count:4 + 2 * count]) == (0, 63, 0)):
            whole = _WholeScan(sum(c.blocks for c in comps.values()),
                               JpegInfo(width=size[0], height=size[1], components=len(comps), progressive=False,
                                        scans=1))
        return cls(size, progressive, restart_interval, scan, tuple((c.ident, c.h, c.v, c.blocks)
                                                                    for c in comps.values()), whole)

    def components(self) -> dict[int, _Component]:
        return {ident: _Component(ident, h, v, blocks) for ident, h, v, blocks in self.comps}


@dataclass(frozen=True)
class _WholeScan:
    """A header whose first scan is sequential and names every component: when EOI follows that scan's data, the
    image is complete (every coefficient coded) and reads as `info`."""

    blocks: int
    info: JpegInfo


class HeaderCache:
    """Headers already walked, keyed by their bytes (SOI up to the end of the first SOS segment). A camera's
    encoder writes the same header on every frame of a size and quality, so the walk of its segments in Python
    (30 us of the 37 that a 224x224 frame's checks took) is paid once per camera, not per frame. Exact byte
    equality is the key, so a hit is the state the walk itself reached on those bytes. Bounded: at most
    `max_entries` headers of at most `max_header_bytes` each; thread-safe (lookups take no lock)."""

    def __init__(self, max_entries: int = 64, max_header_bytes: int = 4096) -> None:
        self.max_entries = max_entries
        self.max_header_bytes = max_header_bytes
        self._known: dict[bytes, _Header] = {}
        self._lock = threading.Lock()

    def lookup(self, data: bytes) -> tuple[_Header, int] | None:
        """The header `data` starts with and the position after it, if walked before. The first FF DA found may
        lie inside a segment (segment payloads are not stuffed): its bytes then match no header walked, a miss."""
        sos = data.find(b"\xff\xda", 2, self.max_header_bytes)
        if sos < 0 or sos + 4 > len(data):
            return None
        end = sos + 2 + ((data[sos + 2] << 8) | data[sos + 3])
        header = self._known.get(data[:end]) if end <= len(data) else None
        return None if header is None else (header, end)

    def remember(self, data: bytes, end: int, header: _Header) -> None:
        if end > self.max_header_bytes:
            return
        key = data[:end]
        with self._lock:
            if key in self._known:
                return
            if len(self._known) >= self.max_entries:
                del self._known[next(iter(self._known))]  # the oldest: a stream that stopped
            self._known[key] = header


HEADERS = HeaderCache()


def _next_marker(data: bytes, pos: int) -> tuple[int | None, int]:
    """The marker code at `pos` (after any fill 0xFFs) and the position after it; (None, pos) at the end.
    Bytes other than 0xFF before it are refused: libjpeg skips them with a "Corrupt JPEG data: extraneous bytes"
    warning, an error to the CPU path's strict libjpeg but not to the device path's decoders (torchvision's
    libjpeg, nvJPEG), so the walk refuses them for both."""
    n = len(data)
    found = data.find(b"\xff", pos)
    if found < 0:
        return None, n
    stray = found - pos
    pos = found
    while pos < n and data[pos] == 0xFF:
        pos += 1
    if pos >= n:
        return None, pos
    if stray:
        raise _bad(f"Corrupt JPEG data: {stray} extraneous bytes before marker 0x{data[pos]:02x}")
    return data[pos], pos + 1


# In entropy-coded data, the 0xFF that a marker code follows (not 00 stuffing, not RST0..7, not one more 0xFF of a
# run of fill bytes): the data ends at the first 0xFF of its run. A pattern of one byte and a one-byte lookahead,
# searched in C in linear time; "a run of 0xFF, then a marker code" as a pattern is quadratic on a long run of 0xFF
# fill bytes that ends in stuffing (30 KB of them: 9 s), which a frame can be made of.
_ENDING_FF = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")
_RESTART = re.compile(rb"\xff[\xd0-\xd7]")


# From this size on, a JPEG's scans are delimited by one vectorised pass (_ScanEnds) instead of a regex search and
# a count per scan: the whole check_jpeg of a 1280x720 frame (145 KB) took about 65 us instead of 168, of 1920x1080
# (327 KB) about 110 instead of 378 (3-4% of one decode thread's CPU per 720p frame; with the default threads no
# measurable change); below it numpy's fixed cost per call loses (8.5 KB: 21 us against 6.5). Above the maximum,
# the positions of the 0xFF bytes (8 bytes each) could take 8x the frame's size in a frame made of 0xFF bytes:
# the regex walk needs no memory.
VECTOR_SCAN_MIN_BYTES = 16 << 10
VECTOR_SCAN_MAX_BYTES = 4 << 20


class _ScanEnds:
    """Every 0xFF of a JPEG that has a byte after it, found in one numpy pass over the whole file, so that each
    scan's end (the same answer as `_scan_data_end`) is a binary search, not a search and a count over its bytes."""

    def __init__(self, data: bytes) -> None:
        raw = np.frombuffer(data, dtype=np.uint8)
        self._ff = np.flatnonzero(raw[:-1] == 0xFF)
        code = raw[self._ff + 1]  # the byte after each 0xFF
        self._restart = (code >= 0xD0) & (code <= 0xD7)
        self._ending = self._ff[(code != 0x00) & (code != 0xFF) & ~self._restart]
        self._restarts_before: np.ndarray | None = None  # restart markers among ff[:i], once a scan needs them

    def _restarts_between(self, lo: int, hi: int) -> int:
        if self._restarts_before is None:
            self._restarts_before = np.concatenate(([0], np.cumsum(self._restart)))
        return int(self._restarts_before[hi] - self._restarts_before[lo])

    def scan_data_end(self, data: bytes, pos: int, restarts: bool) -> tuple[int, int]:
        e = int(np.searchsorted(self._ending, pos))
        if e == len(self._ending):
            raise _truncated_scan()
        stop = _before_fill_bytes(data, pos, int(self._ending[e]))
        lo, hi = (int(i) for i in np.searchsorted(self._ff, (pos, stop)))
        return stop, hi - lo + (self._restarts_between(lo, hi) if restarts else 0)


def _scan_data_end(data: bytes, pos: int, restarts: bool) -> tuple[int, int]:
    """Where the entropy-coded data starting at `pos` ends (the first 0xFF of the run before the next marker that
    is neither a stuffed FF 00 nor a restart marker RST0..7), and how many of its bytes are stuffing or restart
    markers: every 0xFF (a stuffed FF 00 costs one byte, a fill byte one) plus the code byte of each restart marker
    (`restarts`: only a JPEG with a restart interval (DRI) has any; in one without, libjpeg refuses them)."""
    found = _ENDING_FF.search(data, pos)
    if found is None:
        raise _truncated_scan()
    stop = _before_fill_bytes(data, pos, found.start())
    overhead = data.count(b"\xff", pos, stop)
    return stop, overhead + (len(_RESTART.findall(data, pos, stop)) if restarts else 0)


def _truncated_scan() -> FrameDecodeError:
    return _bad("truncated: a scan's data ends before the EOI marker (FF D9)")


def _before_fill_bytes(data: bytes, pos: int, stop: int) -> int:
    """`stop` (the 0xFF a marker code follows), moved back over the 0xFF fill bytes before it to the first of them."""
    if stop > pos and data[stop - 1] == 0xFF:
        stop = pos + len(data[pos:stop].rstrip(b"\xff"))
    return stop


def _read_sof(segment: bytes, comps: dict[int, _Component]) -> tuple[int, int]:
    if len(segment) < 6:
        raise _bad("frame header (SOF) too short")
    precision, height, width, count = struct.unpack_from(">BHHB", segment, 0)
    if precision != 8:
        raise _bad(f"sample precision {precision} bits; only 8 is supported")
    if height == 0 or width == 0:
        raise _bad(f"declares {width}x{height} pixels (a height of 0 means DNL: unsupported)")
    if count not in (1, 3, 4) or len(segment) < 6 + 3 * count:
        raise _bad(f"declares {count} components; supported: 1, 3 or 4")
    for i in range(count):
        ident, sampling, _table = struct.unpack_from(">BBB", segment, 6 + 3 * i)
        h, v = sampling >> 4, sampling & 0x0F
        if not (1 <= h <= 4 and 1 <= v <= 4) or ident in comps:
            raise _bad(f"component {ident} has invalid sampling {h}x{v} or is declared twice")
        comps[ident] = _Component(ident, h, v)
    h_max = max(c.h for c in comps.values())
    v_max = max(c.v for c in comps.values())
    for c in comps.values():
        c_width = -(-width * c.h // h_max)
        c_height = -(-height * c.v // v_max)
        c.blocks = -(-c_width // 8) * -(-c_height // 8)
    return width, height


def _read_scan(data: bytes, pos: int, header: bytes, comps: dict[int, _Component], progressive: bool,
               restarts: bool, ends: _ScanEnds | None = None) -> int:
    """Check one scan's header and that its entropy-coded data can hold its blocks; returns the position of the
    marker that ends the data."""
    if len(header) < 1 or len(header) < 1 + 2 * header[0] + 3:
        raise _bad("scan header (SOS) too short")
    count = header[0]
    idents = [header[1 + 2 * i] for i in range(count)]
    ss, se, approx = header[1 + 2 * count:4 + 2 * count]
    ah, al = approx >> 4, approx & 0x0F
    if count < 1 or any(i not in comps for i in idents) or len(set(idents)) != count:
        raise _bad(f"scan names components {idents}, not those of its frame {sorted(comps)}")
    if not progressive and (ss, se, ah, al) != (0, 63, 0, 0):
        raise _bad("a sequential scan does not cover all 64 coefficients")
    if progressive and not (ss <= se <= 63 and al <= 13 and (ss == 0 or count == 1) and (ss > 0 or se == 0)):
        raise _bad(f"progressive scan with an invalid spectral range {ss}..{se} / bits {ah},{al}")
    # Every block of a scan that codes the DC coefficient takes at least one bit (a Huffman code is >= 1 bit;
    # a refinement scan sends exactly one); a sequential scan adds at least one more (EOB or an AC code).
    # AC-only progressive scans can cover thousands of blocks with one EOB run, so they get no lower bound.
    per_block = (1 if progressive else 2) if ss == 0 else 0
    stop = _scan_end(data, pos, restarts, ends, per_block, sum(comps[i].blocks for i in idents))
    for i in idents:
        lowest = comps[i].lowest_bit
        lowest[ss:se + 1] = [min(bit, al) for bit in lowest[ss:se + 1]] if al else [0] * (se + 1 - ss)
    return stop


def _scan_end(data: bytes, pos: int, restarts: bool, ends: _ScanEnds | None, per_block: int, blocks: int) -> int:
    """Where the scan's entropy-coded data from `pos` ends, once it is known to hold at least `per_block` bits for
    each of its `blocks` blocks."""
    stop, overhead = ends.scan_data_end(data, pos, restarts) if ends else _scan_data_end(data, pos, restarts)
    available_bits = 8 * (stop - pos - overhead)
    needed_bits = per_block * blocks
    if available_bits < needed_bits:
        raise _bad(f"a scan holds {available_bits} bits, fewer than the {needed_bits} its {blocks} blocks need: "
                   "truncated data, or a header claiming a larger image")
    return stop


def _check_complete(comps: dict[int, _Component], progressive: bool) -> None:
    """Every coefficient of every component must be coded down to its last bit, else libjpeg leaves the rest
    at zero (grey, or a blurred image) without an error."""
    for c in comps.values():
        if not any(c.lowest_bit):
            continue
        missing = [k for k, bit in enumerate(c.lowest_bit) if bit != 0]
        if missing:
            what = "is in no scan" if not progressive else \
                f"has coefficients {missing[0]}..{missing[-1]} not fully coded (a progressive JPEG cut short)"
            raise _bad(f"component {c.ident} {what}")

"""A model of PyTorch's CUDA caching allocator, so a CPU run can show reserved memory."""

import bisect
import itertools

MiB = 2**20


class SimulatedOutOfMemoryError(RuntimeError):
    """The modelled CUDA allocator could not stay within `limit_bytes`."""


class CachingAllocatorModel:
    """Replays allocations and frees the way PyTorch's CUDA caching allocator would serve them.

    The rules modelled (the allocator's defaults; expandable segments off):
    - every request is rounded up to a multiple of 512 bytes;
    - requests of at most 1 MiB come from the small pool, larger ones from the large pool;
    - a new segment (one cudaMalloc) is 2 MiB for the small pool, 20 MiB for large requests under
      10 MiB, and the request rounded up to 2 MiB otherwise;
    - a request takes the best-fitting free block of its pool and splits it when the remainder is at
      least 512 bytes (small pool) or more than 1 MiB (large pool);
    - a freed block merges with free neighbours in its segment and stays cached: reserved memory
      never shrinks, except when a request would exceed `limit_bytes`, where wholly free segments
      are released first (as `empty_cache` does on an OOM retry) before giving up.
    Not modelled: streams, events, per-stream pools, garbage-collection thresholds, max_split_size.
    """

    MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, MiB, 2 * MiB
    LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 * MiB, 10 * MiB, 2 * MiB

    def __init__(self, limit_bytes=None):
        self.limit_bytes = limit_bytes
        self.reserved = 0  # bytes held in segments
        self.allocated = 0  # bytes in blocks handed out (rounded sizes)
        self._segments = {}  # segment id -> [size, pool, number of blocks in use]
        self._free = {"small": [], "large": []}  # sorted (size, segment, offset) of free blocks
        self._blocks = {}  # segment id -> {offset: [size, in_use]}
        self._block_ending_at = {}  # segment id -> {end offset: start offset}: left neighbours
        self._live = {}  # allocation key -> (segment, offset)
        self._segment_ids = itertools.count()

    def segments(self):
        """Each segment as (size, pool, blocks), blocks as (offset, size, key; None when free)."""
        keys = {where: key for key, where in self._live.items()}
        return [
            (
                size,
                pool,
                [(o, b[0], keys.get((seg, o))) for o, b in sorted(self._blocks[seg].items())],
            )
            for seg, (size, pool, _) in self._segments.items()
        ]

    @classmethod
    def round_size(cls, nbytes):
        return max(cls.MIN_BLOCK, -(-nbytes // cls.MIN_BLOCK) * cls.MIN_BLOCK)

    @classmethod
    def segment_size(cls, size):
        if size <= cls.SMALL_SIZE:
            return cls.SMALL_BUFFER
        if size < cls.MIN_LARGE_ALLOC:
            return cls.LARGE_BUFFER
        return -(-size // cls.ROUND_LARGE) * cls.ROUND_LARGE

    def malloc(self, key, nbytes):
        size = self.round_size(nbytes)
        pool = "small" if size <= self.SMALL_SIZE else "large"
        free = self._free[pool]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):
            self._new_segment(self.segment_size(size), pool, size)
            i = bisect.bisect_left(free, (size, -1, -1))
        block_size, seg, offset = free.pop(i)
        remainder = block_size - size
        if remainder >= self.MIN_BLOCK if pool == "small" else remainder > self.SMALL_SIZE:
            self._set_block(seg, offset + size, remainder, False)
            bisect.insort(free, (remainder, seg, offset + size))
        else:
            size = block_size
        self._set_block(seg, offset, size, True)
        self._segments[seg][2] += 1
        self._live[key] = (seg, offset)
        self.allocated += size

    def free(self, key):
        seg, offset = self._live.pop(key)
        size = self._pop_block(seg, offset)
        self.allocated -= size
        self._segments[seg][2] -= 1
        pool = self._segments[seg][1]
        blocks = self._blocks[seg]
        right = offset + size
        if right in blocks and not blocks[right][1]:
            right_size = self._pop_block(seg, right)
            self._unfree(pool, seg, right, right_size)
            size += right_size
        left = self._block_ending_at[seg].get(offset)
        if left is not None and not blocks[left][1]:
            left_size = self._pop_block(seg, left)
            self._unfree(pool, seg, left, left_size)
            offset, size = left, size + left_size
        self._set_block(seg, offset, size, False)
        bisect.insort(self._free[pool], (size, seg, offset))

    def _set_block(self, seg, offset, size, in_use):
        self._blocks[seg][offset] = [size, in_use]
        self._block_ending_at[seg][offset + size] = offset

    def _pop_block(self, seg, offset):
        size = self._blocks[seg].pop(offset)[0]
        del self._block_ending_at[seg][offset + size]
        return size

    def _unfree(self, pool, seg, offset, size):
        free = self._free[pool]
        del free[bisect.bisect_left(free, (size, seg, offset))]

    def _new_segment(self, seg_size, pool, request):
        if self.limit_bytes is not None and self.reserved + seg_size > self.limit_bytes:
            self._release_free_segments()
            if self.reserved + seg_size > self.limit_bytes:
                raise SimulatedOutOfMemoryError(
                    f"modelled CUDA out of memory: tried to allocate {request / MiB:.2f} MiB "
                    f"(a new {seg_size / MiB:.0f} MiB segment); {self.allocated / MiB:.2f} MiB "
                    f"allocated, {self.reserved / MiB:.2f} MiB reserved, "
                    f"limit {self.limit_bytes / MiB:.2f} MiB. "
                    "Fix: shrink the batch, shard or drop optimizer state, checkpoint activations, "
                    "or raise limit_bytes."
                )
        seg = next(self._segment_ids)
        self._segments[seg] = [seg_size, pool, 0]
        self._blocks[seg], self._block_ending_at[seg] = {}, {}
        self._set_block(seg, 0, seg_size, False)
        bisect.insort(self._free[pool], (seg_size, seg, 0))
        self.reserved += seg_size

    def _release_free_segments(self):
        for seg, (seg_size, pool, in_use) in list(self._segments.items()):
            if in_use == 0:
                self._unfree(pool, seg, 0, seg_size)
                del self._blocks[seg], self._block_ending_at[seg], self._segments[seg]
                self.reserved -= seg_size

"""The paged KV cache: per-layer key and value block pools.

The pools may store a narrower dtype than the model computes in (a 16-bit
cache under a float32 model, fp8 under a bfloat16 one: engine/kernels/kv_dtype_choice.py).
``to_cache`` rounds keys and values as they are written, ``from_cache``
widens what attention reads back; both are no-ops when the dtypes agree.

On CPU the pools are mapped, not filled: each is an anonymous private
mapping of its own (``mmap``), whose pages the kernel commits as a write
first touches them and which read as zeros until then. The process's
resident memory at start is the model's, not the pool's, and grows with
the blocks written; the pool's size (``kv_cache_memory``) is the cap. The
block manager hands out never-written blocks lowest id first and, on CPU,
reuses every written block (evicting cached content) before it writes a
new one (``BlockManager.reuse_written_first``): the written part is the
front of each layer's pool, as many blocks as requests ever held at once.
That high-water mark stays committed: freed blocks keep their pages (and
the prefix cache its content) for the next holder. A zero fill
(``torch.zeros``) would commit the whole pool at start, gigabytes the
default server never uses.

What attention may read of a block that was never written (the slots of
a context's last block past its end, the padding blocks of a shorter row
in a decode chunk) is under a mask, and a masked key's weight is zero;
but 0 * NaN is NaN, so those slots must hold finite values. A fresh page
reads as zeros, and a slot written before holds a key or value another
sequence stored (finite: narrow dtypes saturate, see ``to_cache``).
``torch.empty`` would not promise that: below glibc's mmap threshold it
hands out reused heap memory with whatever bytes were there. On CUDA
the pool is device memory, not resident host memory, and is zeroed there.

An fp8 pool is held as raw bytes (``torch.uint8``) and only viewed as
``float8_e4m3fn`` to convert, because torch's indexing ops (``index_copy_``,
``index_select``) do not all accept float8 tensors on every device, while
bytes go everywhere.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import attrs
import torch

from trioserve.engine.config import ModelConfig

FP8 = torch.float8_e4m3fn
# How a cache dtype is held, where that differs from the dtype itself.
_STORAGE = {FP8: torch.uint8}
# Narrow dtypes saturate at their largest finite value: float16 would turn
# a larger key into inf and e4m3 into NaN, either of which poisons attention.
_SATURATE = {torch.float16: torch.finfo(torch.float16).max, FP8: torch.finfo(FP8).max}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pool of ``dtype`` is allocated in."""
    return _STORAGE.get(dtype, dtype)


def cache_dtype(storage: torch.dtype) -> torch.dtype:
    """The dtype a pool allocated in ``storage`` holds (the inverse of ``storage_dtype``)."""
    return FP8 if storage == torch.uint8 else storage


def to_cache(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x`` rounded into a pool allocated in ``storage`` (saturating)."""
    if x.dtype == storage:
        return x
    dtype = cache_dtype(storage)
    limit = _SATURATE.get(dtype)
    if limit is not None:
        x = x.clamp(-limit, limit)
    x = x.to(dtype)
    return x if dtype == storage else x.view(storage)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What was read from a pool (``x``, in its storage dtype) as ``dtype``."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.uint8:
        x = x.view(FP8)
    return x.to(dtype)


def as_stored(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x`` as a pool allocated in ``storage`` gives it back: rounded, in ``x``'s dtype."""
    return x if x.dtype == storage else from_cache(to_cache(x, storage), x.dtype)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values, in a cache of ``dtype``."""
    elem = torch.empty((), dtype=storage_dtype(dtype)).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


def mapped_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` on an anonymous private mapping of its own:
    no page is committed until written, and every page reads as zeros until
    then. The tensor keeps the mapping alive; it is unmapped with the tensor."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # MAP_PRIVATE: mmap's default for an anonymous map is MAP_SHARED, which
    # counts as shared memory and is shared with a forked child.
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(area, dtype=dtype).view(shape)


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """How many bytes of a CPU tensor's pages are resident (``mincore``),
    rounded out to whole pages; None where that cannot be asked (not Linux,
    not CPU). A page only read since it was mapped counts too (the kernel
    maps the shared zero page there), though it adds nothing to the RSS."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if mincore(start, end - start, vec) != 0:
        return None
    # Bit 0 of each byte: the page is resident; the other bits are reserved.
    return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) * page


@attrs.define
class KVCache:
    """Key and value pools, each ``[num_layers, num_blocks, block_size, kv_heads, head_dim]``.

    ``key[layer]`` is the ``[num_blocks, block_size, kv_heads, head_dim]`` pool
    of that layer. One allocation for all layers keeps the pool contiguous and
    lets a slot index (``block_id * block_size + offset``) address a token's
    row in a ``[num_blocks * block_size, kv_heads, head_dim]`` view directly.
    The pools are in ``storage_dtype(dtype)``; ``dtype`` is what they hold.

    Split (``allocate_split``, a model with sliding-window layers): ``key``
    and ``value`` hold only the layers that attend to the whole context,
    ``window`` is a ``KVCache`` of its own for the sliding layers (its own
    number of blocks, its own block tables: engine/core/block_manager.py),
    and ``window_layers`` says, per model layer, which of the two holds it.
    ``layer_pools`` gives each layer its pools either way.
    """

    key: torch.Tensor
    value: torch.Tensor
    window: KVCache | None = None
    window_layers: tuple[bool, ...] = ()

    @classmethod
    def allocate(
        cls, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        storage = storage_dtype(dtype)
        # Never garbage, which could be NaN: decode reads padding slots under
        # a mask, and a zero attention weight keeps NaN (0 * NaN). On CPU a
        # fresh mapping reads as zeros and commits nothing until written (the
        # module's docstring); elsewhere, zeros in device memory.
        if torch.device(device).type == "cpu":
            return cls(key=mapped_pool(shape, storage), value=mapped_pool(shape, storage))
        return cls(
            key=torch.zeros(shape, dtype=storage, device=device),
            value=torch.zeros(shape, dtype=storage, device=device),
        )

    @classmethod
    def allocate_split(
        cls,
        config: ModelConfig,
        *,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Pools of ``num_blocks`` for the layers that see the whole context
        and, in ``window``, of ``num_window_blocks`` for the sliding-window
        layers (``config.layer_window``); either group may have no layers
        (Mistral v0.1: every layer slides)."""
        slides = tuple(config.layer_window(i) is not None for i in range(config.num_hidden_layers))
        full = cls.allocate(
            attrs.evolve(config, num_hidden_layers=slides.count(False)),
            num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
        )  # fmt: skip
        window = cls.allocate(
            attrs.evolve(config, num_hidden_layers=slides.count(True)),
            num_blocks=num_window_blocks, block_size=block_size, dtype=dtype, device=device,
        )  # fmt: skip
        return cls(key=full.key, value=full.value, window=window, window_layers=slides)

    def layer_pools(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Per model layer: its key pool, its value pool, and whether they
        are the window group's (then its slots and tables are the batch's
        ``window_`` ones)."""
        if self.window is None:
            return [(k, v, False) for k, v in zip(self.key, self.value)]
        full = iter(zip(self.key, self.value))
        window = iter(zip(self.window.key, self.window.value))
        return [(*next(window if slides else full), slides) for slides in self.window_layers]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the pools hold (float8 for an fp8 pool held as bytes)."""
        return cache_dtype(self.key.dtype)

    @property
    def nbytes(self) -> int:
        """The pools' bytes, keys and values (the window group's included)."""
        return self.key.nbytes + self.value.nbytes + (0 if self.window is None else self.window.nbytes)

    def resident_bytes(self) -> int | None:
        """The pools' bytes in resident pages (``resident_bytes``; None off
        CPU or Linux), the window group's included. A group without layers
        has no pages."""
        total = 0
        for pool in (self.key, self.value):
            if pool.numel():
                found = resident_bytes(pool)
                if found is None:
                    return None
                total += found
        if self.window is not None:
            window = self.window.resident_bytes()
            return None if window is None else total + window
        return total

    @property
    def token_bytes(self) -> int:
        """Bytes one token's keys and values take in one layer's pools."""
        return 2 * math.prod(self.key.shape[3:]) * self.key.element_size()

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[2])

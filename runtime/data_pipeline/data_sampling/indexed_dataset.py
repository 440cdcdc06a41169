"""``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: Megatron's memory-mapped
indexed dataset, the on-disk format of DeepSpeed's data-efficiency files (the analyzer's metric
indexes, the sampler's clusters) and of Megatron's tokenised corpora.

A dataset ``<prefix>`` is two files. ``<prefix>.bin`` holds every item's elements back to back
(one numpy dtype). ``<prefix>.idx`` is the index, little-endian:

- the 9-byte magic ``MMIDIDX\\0\\0``, the version (u64, 1), the dtype's code (u8, ``DTYPES``);
- the number of items and the number of entries of the document index (u64 each);
- the items' sizes (int32 each), their byte offsets in ``.bin`` (int64 each), the document index
  (int64 each: the first item of each document, then the count).

``MMapIndexedDatasetBuilder`` writes the same bytes DeepSpeed's builder writes for the same items
(tests compare them byte for byte), and ``MMapIndexedDataset`` reads files DeepSpeed or Megatron
made. Files are written through ``dslaunch/safe_write.py`` (never through a planted link).

Differences from DeepSpeed: a file that is not an index, of another version or with an unknown
dtype code is a ``DatasetFormatError`` naming the file (DeepSpeed asserts); the reader prints
nothing (DeepSpeed prints five progress lines per dataset opened); ``merge_file_`` of another
dtype names both (DeepSpeed asserts). The legacy non-mmap formats (``lazy``, ``cached``:
``IndexedDataset``, ``IndexedDatasetBuilder``) are not here: ``make_dataset``/``make_builder``
with them raise ``NotInDslaunchError``.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from dslaunch.errors import DslaunchError, NotInDslaunchError
from dslaunch.safe_write import create_replacing, split_path, write_file

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder", "DatasetFormatError", "DTYPES", "dtypes",
           "valid_dtypes", "code", "index_file_path", "data_file_path", "make_builder", "make_dataset",
           "dataset_exists", "infer_dataset_impl", "get_available_dataset_impl", "create_doc_idx",
           "get_pointers_with_total", "exscan_from_cumsum_"]

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1


class DatasetFormatError(DslaunchError, ValueError):
    """A file that is not a readable memory-mapped indexed dataset (named in the message)."""


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


# dtype code -> (numpy dtype, torch dtype or None): the codes DeepSpeed and Megatron write.
DTYPES: dict[int, tuple[Any, Any]] = {
    1: (np.uint8, _torch_dtype("uint8")), 2: (np.int8, _torch_dtype("int8")), 3: (np.int16, _torch_dtype("int16")),
    4: (np.int32, _torch_dtype("int32")), 5: (np.int64, _torch_dtype("int64")), 6: (np.uint16, None),
    7: (np.uint32, None), 8: (np.uint64, None),
}
dtypes = DTYPES  # DeepSpeed's name
valid_dtypes = {np_dt for np_dt, _ in DTYPES.values()} | {t for _, t in DTYPES.values() if t is not None}


def code(dtype: Any) -> int:
    """The index code of ``dtype`` (a numpy or torch dtype).

    Raises:
        ValueError: a dtype the format cannot hold.
    """
    for number, (np_dt, torch_dt) in DTYPES.items():
        if dtype in (np_dt, torch_dt) or (torch_dt is None and np.dtype(np_dt) == _as_numpy(dtype)):
            return number
    raise ValueError(f"{dtype} not supported by the indexed dataset format; use one of "
                     f"{', '.join(np.dtype(t).name for t, _ in DTYPES.values())}")


def _as_numpy(dtype: Any) -> Any:
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def _numpy_dtype(dtype: Any) -> Any:
    return DTYPES[code(dtype)][0]


def index_file_path(prefix_path: str) -> str:
    return prefix_path + ".idx"


def data_file_path(prefix_path: str) -> str:
    return prefix_path + ".bin"


def get_available_dataset_impl() -> list[str]:
    return ["lazy", "cached", "mmap"]


def create_doc_idx(sizes: Sequence[int]) -> list[int]:
    """A document index where an empty item ends a document (Megatron's convention)."""
    return [0] + [i + 1 for i, size in enumerate(sizes) if size == 0]


def exscan_from_cumsum_(arr: np.ndarray) -> None:
    """Turn an inclusive prefix sum into an exclusive one, in place ([10, 30] -> [0, 10])."""
    if arr.size > 1:
        arr[1:] = arr[:-1]
    if arr.size > 0:
        arr[0] = 0


def get_pointers_with_total(sizes: Sequence[int], elemsize: int, dtype: Any) -> tuple[np.ndarray, int]:
    """Byte offsets of items of ``sizes`` elements of ``elemsize`` bytes, and the total bytes."""
    pointers = np.array(sizes, dtype=dtype) * elemsize
    np.cumsum(pointers, axis=0, out=pointers)
    total = int(pointers[-1]) if len(sizes) > 0 else 0
    exscan_from_cumsum_(pointers)
    return pointers, total


class _Index:
    """The ``.idx`` file of one dataset, memory-mapped: sizes, pointers, document index."""

    def __init__(self, path: str):
        try:
            with open(path, "rb") as stream:
                header = stream.read(len(_MAGIC) + 8 + 1 + 16)
        except OSError as err:
            raise DatasetFormatError(f"{path}: cannot read the index ({err.strerror or err})") from None
        if len(header) < 34 or header[:9] != _MAGIC:
            raise DatasetFormatError(f"{path}: not a memory-mapped indexed dataset index (no MMIDIDX magic); "
                                     "give the prefix of a .bin/.idx pair made by an mmap builder")
        version, dtype_code, length, doc_count = struct.unpack("<QBQQ", header[9:])
        if version != _VERSION or dtype_code not in DTYPES:
            raise DatasetFormatError(f"{path}: index version {version} with dtype code {dtype_code}; only version "
                                     f"1 with codes {sorted(DTYPES)} can be read")
        self.dtype = DTYPES[dtype_code][0]
        self._mmap = np.memmap(path, mode="r", order="C")
        buffer = memoryview(self._mmap)
        offset = len(header)
        self.sizes = np.frombuffer(buffer, dtype=np.int32, count=length, offset=offset)
        self.pointers = np.frombuffer(buffer, dtype=np.int64, count=length, offset=offset + self.sizes.nbytes)
        self.doc_idx = np.frombuffer(buffer, dtype=np.int64, count=doc_count,
                                     offset=offset + self.sizes.nbytes + self.pointers.nbytes)

    def __len__(self) -> int:
        return len(self.sizes)


def _warm_up(path: str) -> None:
    with open(path, "rb") as stream:  # read once so the first epoch does not page in lazily
        while stream.read(100 * 1024 * 1024):
            pass


class MMapIndexedDataset:
    """Items of a ``<prefix>.bin``/``.idx`` pair as numpy arrays, memory-mapped (read-only).

    ``ds[i]`` is item ``i`` (a view into the map), ``ds[a:b]`` a list of items (contiguous slices
    only), ``ds.get(i, offset, length)`` part of one item. Pickles as its path (DataLoader workers
    re-open it).

    Args:
        path: the prefix (without ``.bin``/``.idx``).
        skip_warmup: do not read both files through once first.

    Raises:
        DatasetFormatError: a missing or unreadable file (named).
    """

    Index = _Index

    def __init__(self, path: str, skip_warmup: bool = False):
        self._do_init(path, skip_warmup)

    def _do_init(self, path: str, skip_warmup: bool = True) -> None:
        self._path = path
        self._index = _Index(index_file_path(path))
        data = data_file_path(path)
        if not os.path.isfile(data):
            raise DatasetFormatError(f"{data}: the data file of indexed dataset {path} is missing")
        if not skip_warmup:
            _warm_up(index_file_path(path))
            _warm_up(data)
        # np.memmap of an empty file fails; an empty dataset reads from an empty buffer
        self._bin_buffer_mmap = np.memmap(data, mode="r", order="C") if os.path.getsize(data) else np.empty(0, np.uint8)
        self._bin_buffer = memoryview(self._bin_buffer_mmap)

    def __getstate__(self) -> str:
        return self._path

    def __setstate__(self, state: str) -> None:
        self._do_init(state)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            sizes = self._index.sizes[idx]
            if len(sizes) == 0:
                return []
            flat = np.frombuffer(self._bin_buffer, dtype=self.dtype, count=int(sizes.sum()),
                                 offset=int(self._index.pointers[start]))
            return np.split(flat, list(accumulate(sizes))[:-1])
        i = int(idx)
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=int(self._index.sizes[i]),
                             offset=int(self._index.pointers[i]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Elements ``offset`` to ``offset + length`` (default: to the end) of item ``idx``."""
        size = int(self._index.sizes[idx])
        count = size - offset if length is None else length
        start = int(self._index.pointers[idx]) + offset * np.dtype(self.dtype).itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=count, offset=start)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    def size(self, index: int) -> int:
        return self._index.sizes[index]

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def set_doc_idx(self, doc_idx_: np.ndarray) -> None:
        self._index.doc_idx = doc_idx_

    @property
    def supports_prefetch(self) -> bool:
        return False

    @property
    def dtype(self) -> Any:
        return self._index.dtype

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def _index_bytes(dtype: Any, sizes: Sequence[int], doc_idx: Sequence[int]) -> bytes:
    pointers, _ = get_pointers_with_total(sizes, np.dtype(dtype).itemsize, np.int64)
    return b"".join((_MAGIC, struct.pack("<QB", _VERSION, code(dtype)), struct.pack("<QQ", len(sizes), len(doc_idx)),
                     np.array(sizes, dtype=np.int32).tobytes(order="C"), pointers.tobytes(order="C"),
                     np.array(doc_idx, dtype=np.int64).tobytes(order="C")))


class MMapIndexedDatasetBuilder:
    """Writes a dataset: items appended to ``out_file`` (the ``.bin``) as they come, the index at
    ``finalize(<prefix>.idx)``.

    Args:
        out_file: the data file's path (an old file there is replaced, never written through).
        dtype: the elements' numpy or torch dtype (items are converted to it).

    Raises:
        ValueError: a dtype the format cannot hold.
    """

    def __init__(self, out_file: str, dtype: Any = np.int64):
        self._dtype = _numpy_dtype(dtype)
        head, name = split_path(out_file)
        self._name = out_file
        self._data_file = os.fdopen(create_replacing(head, name, 0o644), "wb")
        self._sizes: list[int] = []
        self._doc_idx = [0]

    def _write(self, array: np.ndarray) -> None:
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_item(self, tensor: Any) -> None:
        """Append one item (a torch tensor)."""
        self._write(np.array(tensor.numpy(), dtype=self._dtype))

    def add_items(self, arr_list: Sequence[np.ndarray]) -> None:
        """Append several numpy arrays as items."""
        for array in arr_list:
            self._write(array.astype(self._dtype))

    def add_item_numpy(self, np_array: np.ndarray) -> None:
        """Append one numpy array as an item."""
        self._write(np_array if np_array.dtype == self._dtype else np_array.astype(self._dtype))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file: str) -> None:
        """Append every item and document of dataset ``another_file`` (a prefix).

        Raises:
            DatasetFormatError: it is not a dataset, or holds another dtype.
        """
        index = _Index(index_file_path(another_file))
        if index.dtype != self._dtype:
            raise DatasetFormatError(f"{another_file}: holds {np.dtype(index.dtype).name}, but {self._name} is "
                                     f"being built with {np.dtype(self._dtype).name}")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in index.sizes)
        self._doc_idx.extend(int(d) + offset for d in index.doc_idx[1:])
        with open(data_file_path(another_file), "rb") as f:
            shutil.copyfileobj(f, self._data_file)
        self._data_file.flush()

    def finalize(self, index_file: str) -> None:
        """Close the data file and write the index to ``index_file`` (replacing what is there)."""
        self._data_file.close()
        head, name = split_path(index_file)
        write_file(head, name, _index_bytes(self._dtype, self._sizes, self._doc_idx))


def _best_fitting_dtype(vocab_size: int | None) -> Any:
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def _not_mmap(impl: str) -> NotInDslaunchError:
    return NotInDslaunchError(f"indexed dataset impl {impl!r}: only 'mmap' (MMapIndexedDataset) is in dslaunch; "
                              "the legacy 'lazy'/'cached' formats are not")


def make_builder(out_file: str, impl: str, vocab_size: int | None = None) -> MMapIndexedDatasetBuilder:
    """A builder of ``impl`` 'mmap' (uint16 tokens for a vocabulary under 65500, else int32).

    Raises:
        NotInDslaunchError: another ``impl``.
    """
    if impl != "mmap":
        raise _not_mmap(impl)
    return MMapIndexedDatasetBuilder(out_file, dtype=_best_fitting_dtype(vocab_size))


def infer_dataset_impl(path: str) -> str | None:
    """'mmap' or 'cached' by the index's magic; None when there is no dataset at ``path``."""
    if not MMapIndexedDataset.exists(path):
        return None
    with open(index_file_path(path), "rb") as f:
        magic = f.read(9)
    return "mmap" if magic == _MAGIC else "cached" if magic[:8] == b"TNTIDX\x00\x00" else None


def make_dataset(path: str, impl: str, skip_warmup: bool = False) -> MMapIndexedDataset | None:
    """The dataset at ``path`` (None when its files are missing, as DeepSpeed's).

    Raises:
        NotInDslaunchError: ``impl`` (or the inferred one) is not 'mmap'.
    """
    if not MMapIndexedDataset.exists(path):
        return None
    impl = infer_dataset_impl(path) or impl if impl == "infer" else impl
    if impl != "mmap":
        raise _not_mmap(impl)
    return MMapIndexedDataset(path, skip_warmup)


def dataset_exists(path: str, impl: str) -> bool:
    return MMapIndexedDataset.exists(path)

"""Type stubs for the Rust extension module (checked by mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, SupportsIndex, TypeAlias, final, overload

import numpy as np
import numpy.typing as npt

__version__: str

# The public API, as the extension's `__all__` lists it (its exports but the internal `_`
# names and the proxy's StreamMerger; stubtest holds the two equal). `routed_experts`
# re-exports it whole.
__all__ = [
    "Agreement",
    "BodyReader",
    "ConfigError",
    "ExpertLoad",
    "FORMATS",
    "MergeError",
    "PayloadError",
    "RoutedExperts",
    "RoutedExpertsError",
    "Trajectory",
    "agreement",
    "decode",
    "detect_format",
    "encode",
    "expert_load",
    "from_response",
    "get_max_bytes",
    "group_from_response",
    "merge",
    "merge_response",
    "pack",
    "pack_shard",
    "set_max_bytes",
    "shard",
]

_DTypeLike: TypeAlias = str | npt.DTypeLike
_JsonInput: TypeAlias = bytes | bytearray | memoryview | str | dict[str, Any]
class _ResponseModel(Protocol):
    """A pydantic model that keeps a server's extra fields: the OpenAI SDK's `Completion`,
    `ChatCompletion` and their stream chunks (routing rides in `model_extra`)."""

    @property
    def model_extra(self) -> dict[str, Any] | None: ...
    def model_dump_json(self, *, exclude_unset: bool = ...) -> str: ...

_Body: TypeAlias = bytes | bytearray | memoryview | str | dict[str, Any] | _ResponseModel
_Overlap: TypeAlias = Literal["keep", "replace", "check"]
_Pad: TypeAlias = Literal["repeat", "zero"]
_Format: TypeAlias = Literal["compact", "vllm_npy", "sglang", "nemo", "lists"]
FORMATS: tuple[_Format, ...]  # every format's name, in the order detection reports them
_IntArray: TypeAlias = np.ndarray[Any, np.dtype[np.integer[Any]]]
_FloatArray: TypeAlias = np.ndarray[Any, np.dtype[np.float64]]
_BoolArray: TypeAlias = np.ndarray[Any, np.dtype[np.bool_]]
# A routing for the quality functions: a payload, or an integer array (numpy, CPU torch tensor).
_Routing: TypeAlias = RoutedExperts | npt.ArrayLike

# Which rule an error broke: the core's `ErrorKind` by name (docs/format.md §8).
_ErrorKind: TypeAlias = Literal[
    "field", "json", "counts", "row", "id", "rows_lost", "too_large", "unplaced", "offloaded",
    "unpadded", "not_response", "malformed", "gap", "shape", "missing_routing", "overlap",
    "inconsistent",
]
_ERROR_KINDS: tuple[_ErrorKind, ...]

class RoutedExpertsError(ValueError):
    # The rule broken, when the core raised it (None for checks made in Python), and the
    # values its kind carries ({"stop": 3, "start": 5} for a gap).
    kind: _ErrorKind | None
    details: Mapping[str, Any]

class PayloadError(RoutedExpertsError): ...
class MergeError(RoutedExpertsError): ...
class ConfigError(RoutedExpertsError): ...

@final
class RoutedExperts:
    @staticmethod
    def from_json(value: _JsonInput, *, max_bytes: int | None = None) -> RoutedExperts: ...
    @staticmethod
    def from_array(
        array: npt.ArrayLike,
        start: int = 0,
        dtype: _DTypeLike | None = None,
        num_experts: int | None = None,
    ) -> RoutedExperts: ...
    @property
    def array(self) -> np.ndarray[Any, np.dtype[np.integer[Any]]]: ...
    def __array__(self, dtype: _DTypeLike | None = None, copy: bool | None = None) -> _IntArray: ...
    def to_numpy(
        self, dtype: _DTypeLike | None = None, *, writable: bool = False
    ) -> np.ndarray[Any, np.dtype[np.integer[Any]]]: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def shape(self) -> tuple[int, int, int]: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def to_json(self) -> bytes: ...
    def to_dict(self) -> dict[str, Any]: ...
    def slice(self, start: int, stop: int) -> RoutedExperts: ...
    def astype(self, dtype: _DTypeLike) -> RoutedExperts: ...
    def validate(
        self,
        num_experts: int | None = None,
        duplicates: bool = True,
        zero_rows: bool = True,
        missing_rows: bool = False,
    ) -> None: ...
    def validation_report(
        self,
        num_experts: int | None = None,
        duplicates: bool = True,
        zero_rows: bool = True,
        missing_rows: bool = False,
    ) -> dict[str, Any]: ...
    def to_torch(self, dtype: Any = None) -> Any: ...
    def to_transport(self) -> tuple[bytes, list[int], str]: ...
    @staticmethod
    def from_transport(value: tuple[Any, list[int], str], start: int = 0) -> RoutedExperts: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]: ...

@final
class Trajectory:
    def __init__(self) -> None: ...
    def append(
        self, payload: RoutedExperts | _JsonInput | _ResponseModel, overlap: _Overlap = "keep"
    ) -> None: ...
    @property
    def start(self) -> int | None: ...
    @property
    def stop(self) -> int | None: ...
    @property
    def dtype(self) -> np.dtype[Any] | None: ...
    def __len__(self) -> int: ...
    @property
    def payload(self) -> RoutedExperts | None: ...
    def truncate(self, stop: int) -> None: ...
    def copy(self) -> Trajectory: ...
    def __copy__(self) -> Trajectory: ...
    @overload
    def to_training(
        self,
        num_tokens: int,
        pad: _Pad = "repeat",
        max_missing: int = 1,
        *,
        mask: Literal[False] = False,
        dtype: str | None = None,
    ) -> _IntArray: ...
    @overload
    def to_training(
        self,
        num_tokens: int,
        pad: _Pad = "repeat",
        max_missing: int = 1,
        *,
        mask: Literal[True],
        dtype: str | None = None,
    ) -> tuple[_IntArray, _BoolArray]: ...

@final
class Agreement:
    @property
    def exact_match(self) -> float: ...
    @property
    def overlap(self) -> float: ...
    @property
    def tokens_with_difference(self) -> float: ...
    @property
    def differing_per_token(self) -> float: ...
    @property
    def exact_match_per_layer(self) -> _FloatArray: ...
    @property
    def overlap_per_layer(self) -> _FloatArray: ...
    @property
    def compared_rows(self) -> int: ...
    @property
    def excluded_rows(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def no_router_layers(self) -> list[int]: ...
    def to_dict(self) -> dict[str, Any]: ...

@final
class ExpertLoad:
    @property
    def counts(self) -> np.ndarray[Any, np.dtype[np.int64]]: ...
    @property
    def imbalance(self) -> _FloatArray: ...
    @property
    def cv(self) -> _FloatArray: ...
    @property
    def never_chosen_per_layer(self) -> np.ndarray[Any, np.dtype[np.uint64]]: ...
    @property
    def never_chosen(self) -> np.ndarray[Any, np.dtype[np.uint64]]: ...
    @property
    def rows(self) -> int: ...
    @property
    def missing_rows(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...

def agreement(a: _Routing, b: _Routing) -> Agreement: ...
def expert_load(
    routing: _Routing | list[_Routing] | tuple[_Routing, ...], num_experts: int
) -> ExpertLoad: ...

def merge(
    prefill: RoutedExperts | _JsonInput, decode: RoutedExperts | _JsonInput
) -> RoutedExperts: ...
def from_response(
    body: _Body,
    choice: int = 0,
    *,
    start: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: _DTypeLike | None = None,
    max_bytes: int | None = None,
) -> RoutedExperts | None: ...
def group_from_response(
    body: _Body,
    *,
    start: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: _DTypeLike | None = None,
    max_bytes: int | None = None,
) -> list[tuple[RoutedExperts, RoutedExperts] | tuple[RoutedExperts]]: ...
@final
class BodyReader:
    """A response body read as it arrives: `feed` each chunk, then `group()` reads it as
    `group_from_response` reads the whole body, each long base64 `data` string held decoded."""

    def __new__(cls, *, max_bytes: int | None = None) -> BodyReader: ...
    def feed(self, chunk: bytes | bytearray | memoryview | str) -> None: ...
    def group(
        self,
        *,
        start: int | None = None,
        num_layers: int | None = None,
        top_k: int | None = None,
        dtype: _DTypeLike | None = None,
        max_bytes: int | None = None,
    ) -> list[tuple[RoutedExperts, RoutedExperts] | tuple[RoutedExperts]]: ...
    @property
    def text_bytes(self) -> int: ...
    @property
    def decoded_bytes(self) -> int: ...

def merge_response(
    prefill_body: _Body,
    decode_body: _Body,
    *,
    start: int | None = None,
    decode_start: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: _DTypeLike | None = None,
    keep_format: bool = False,
    splice: bool = True,
    max_bytes: int | None = None,
    require_routing: bool = False,
    shared_prompt: bool = False,
) -> bytes: ...
def decode(
    value: Any,
    *,
    start: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    dtype: _DTypeLike | None = None,
    max_bytes: int | None = None,
) -> RoutedExperts: ...
def encode(payload: RoutedExperts, format: _Format = "compact") -> Any: ...
def detect_format(value: Any) -> _Format: ...
# A payload, a trajectory, a sample's parts (group_from_response's tuples), or an integer array
# (rows from 0).
_Sample: TypeAlias = RoutedExperts | Trajectory | tuple[RoutedExperts, ...] | Any

@overload
def pack(
    samples: Sequence[_Sample],
    dtype: str | None = "int32",
    pad_to_multiple: int | None = None,
    *,
    num_tokens: Sequence[int] | None = None,
    pad_each_to_multiple: int | None = None,
    mask: Literal[False] = False,
) -> tuple[_IntArray, np.ndarray[Any, np.dtype[np.int32]]]: ...
@overload
def pack(
    samples: Sequence[_Sample],
    dtype: str | None = "int32",
    pad_to_multiple: int | None = None,
    *,
    num_tokens: Sequence[int] | None = None,
    pad_each_to_multiple: int | None = None,
    mask: Literal[True],
) -> tuple[_IntArray, np.ndarray[Any, np.dtype[np.int32]], _BoolArray]: ...
def pack_shard(
    samples: Sequence[_Sample],
    dtype: str | None = "int32",
    pad_to_multiple: int | None = None,
    *,
    num_tokens: Sequence[int] | None = None,
    pad_each_to_multiple: int | None = None,
    mask: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_split: Literal["zigzag", "contiguous"] = "zigzag",
    tp_size: int = 1,
    tp_rank: int = 0,
    layers: tuple[int, int] | None = None,
    out: np.ndarray | None = None,
) -> tuple[_IntArray, np.ndarray[Any, np.dtype[np.int32]], _BoolArray | None]: ...
def shard(
    batch: Any,
    cu_seqlens: Any,
    mask: Any | None = None,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_split: Literal["zigzag", "contiguous"] = "zigzag",
    tp_size: int = 1,
    tp_rank: int = 0,
    layers: tuple[int, int] | None = None,
) -> tuple[_IntArray, np.ndarray[Any, np.dtype[np.int32]], _BoolArray | None]: ...
def _replay_ids(
    batch: np.ndarray,
    layers: list[int],
    mask: np.ndarray | None,
    num_experts: int,
    places: list[str],
    dtype: str,
    origin: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
def _sniff(
    data: bytes | bytearray | memoryview | str,
) -> tuple[
    Literal["empty", "npy", "binary", "routing", "response", "error_reply", "json", "text"],
    str | None,
    int | None,
]: ...
def set_max_bytes(n: int) -> None: ...
def get_max_bytes() -> int: ...
def _from_raw(data: Any, shape: tuple[int, int, int], start: int, dtype: str) -> RoutedExperts: ...
def _trajectory_from_payload(payload: RoutedExperts | None) -> Trajectory: ...
@final
class StreamMerger:
    def __new__(
        cls, prefill_body: _Body, start: int | None = None, max_line_bytes: int | None = None
    ) -> StreamMerger: ...
    def feed(self, chunk: _Body) -> list[bytes]: ...
    def line(self, line: _Body) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...
    @property
    def merged(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def merged_bytes(self) -> int: ...
    @property
    def buffered(self) -> int: ...

def _proxy_settings() -> list[tuple[str, str, int, int, str]]: ...
def _proxy_text_settings() -> list[tuple[str, str | None, str]]: ...
def _proxy_choices() -> list[tuple[str, list[str]]]: ...
def _proxy_protocol() -> tuple[list[str], str, str]: ...
def _check_proxy_settings(settings: dict[str, Any]) -> None: ...
@final
class _ProxyServer:
    def __new__(
        cls,
        prefill: list[str],
        decode: list[str],
        host: str,
        port: int,
        settings: dict[str, Any],
        admin_port: int | None = None,
    ) -> _ProxyServer: ...
    @property
    def port(self) -> int: ...
    @property
    def admin_port(self) -> int | None: ...
    def serve(self, signals: bool = False) -> None: ...
    def stop(self, now: bool = False) -> None: ...

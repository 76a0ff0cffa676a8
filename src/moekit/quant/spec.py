"""Weight formats: one frozen spec type per quantized format, with its parameters and the exact
layout of its tensors.

A weight is a matrix [.., N, K] (N output rows, K the reduction / input dim) with any leading dims
(the expert dim E for MoE weights: w13 is N = 2I, K = H; w2 is N = H, K = I). Every format keeps
the logical shape and stores (dequantization is always `value * scale`, never a division):

  format       data [.., N, K/pack]       scale                            extra
  fp8_w8a8     float8_e4m3fn              float32: tensor [..] | channel
                                          [.., N] | block [.., ceil(N/bn),
                                          ceil(K/bk)]
  int8_w8a8    int8                       float32 [.., N]
  int8_w8a16   int8                       float32 [.., N]
  int4_w4a16   uint8, 2 per byte          scale_dtype [.., N, K/g]         zero uint8 [.., N, K/g]
                                                                           (asymmetric only)
  mxfp4        uint8, 2 e2m1 per byte     uint8 e8m0 [.., N, K/32]
  nvfp4        uint8, 2 e2m1 per byte     float8_e4m3fn [.., N, K/16]      global_scale float32 [..]

Packed nibbles: element 2j of a row is the low nibble of byte j, element 2j+1 the high nibble
(see `moekit.quant.packing`). int4 values are unsigned 0..15 with w = (q - zero) * scale; the
symmetric variant stores no zero tensor and uses zero = 8.

Activation schemes of the w8a8 formats (how a kernel quantizes the activations it multiplies):
'static_tensor' (one calibrated scale per expert, `a13_scale` / `a2_scale` [E] in ExpertWeights),
'dynamic_tensor' (one scale over the whole activation tensor, computed per call), 'token' (one
scale per row) and 'token_group' (one per row and group of `act_group_size` columns). Weight-only
formats (w8a16, w4a16, mxfp4, nvfp4) multiply in the activation dtype: act_scheme is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from moekit.config import WEIGHT_FORMATS, ConfigError

ACT_SCHEMES = ("static_tensor", "dynamic_tensor", "token", "token_group")
FP8_WEIGHT_SCALES = ("tensor", "channel", "block")
FP8_BLOCK_SHAPES = ((128, 128),)
ACT_GROUP_SIZES = (128,)
INT4_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
E2M1_MAX = 6.0


def _choice(fmt: str, option: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(
            f"{fmt}: {option} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )


@dataclass(frozen=True)
class QuantSpec:
    """Base of the per-format specs. Subclasses set the class constants and their parameters."""

    name: ClassVar[str]
    data_dtype: ClassVar[torch.dtype]
    pack_factor: ClassVar[int] = 1  # logical values per stored element along K

    # --- what the activations do -------------------------------------------------------------
    @property
    def act_scheme(self) -> str | None:
        """How activations are quantized ('static_tensor' ...), None for weight-only formats."""
        return None

    @property
    def act_dtype(self) -> torch.dtype | None:
        """The dtype activations are quantized to (w8a8 formats), None for weight-only ones."""
        return None

    @property
    def act_group_size(self) -> int | None:
        return None

    @property
    def weight_only(self) -> bool:
        return self.act_scheme is None

    # --- the tensors ---------------------------------------------------------------------------
    def check_k(self, N: int, K: int, what: str = "weight") -> None:
        """Raise ValueError if a weight [.., N, K] cannot be stored in this format."""

    def data_shape(self, N: int, K: int) -> tuple[int, int]:
        return (N, K // self.pack_factor)

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        """Shape of the scale of one [N, K] matrix (leading dims are prepended)."""
        raise NotImplementedError

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def has_zero(self) -> bool:
        return False

    @property
    def has_global_scale(self) -> bool:
        return False

    def describe(self) -> str:
        """'fp8_w8a8(weight_scale=block, ...)': the name with the parameters."""
        params = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"{self.name}({params})" if params else self.name

    def check_tensors(
        self,
        lead: tuple[int, ...],
        N: int,
        K: int,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        zero: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
        what: str = "weight",
    ) -> None:
        """Raise ValueError naming `what` unless the tensors have this format's shapes/dtypes
        for a logical weight [*lead, N, K]."""
        self.check_k(N, K, what)
        lead = tuple(lead)
        _expect(f"{what} data", data, lead + self.data_shape(N, K), self.data_dtype, self)
        if scale is None:
            raise ValueError(f"{what}: format {self.describe()} needs a scale tensor, got None")
        _expect(f"{what}_scale", scale, lead + self.scale_shape(N, K), self.scale_dtype, self)
        if self.has_zero:
            if zero is None:
                raise ValueError(f"{what}: format {self.describe()} needs zero points, got None")
            _expect(f"{what}_zero", zero, lead + self.scale_shape(N, K), torch.uint8, self)
        elif zero is not None:
            raise ValueError(f"{what}: format {self.describe()} has no zero points; got a tensor")
        if self.has_global_scale:
            if global_scale is None:
                raise ValueError(f"{what}: format {self.describe()} needs a global scale")
            _expect(f"{what}_global_scale", global_scale, lead, torch.float32, self)
        elif global_scale is not None:
            raise ValueError(f"{what}: format {self.describe()} has no global scale; got a tensor")


def _expect(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, spec: QuantSpec):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{name}: format {spec.describe()} needs shape {list(shape)}, got {list(t.shape)}"
        )
    if t.dtype != dtype:
        raise ValueError(f"{name}: format {spec.describe()} needs dtype {dtype}, got {t.dtype}")


def _divides(fmt: str, option: str, g: int, K: int, what: str) -> None:
    if K % g:
        raise ValueError(
            f"{what}: {fmt} {option} {g} must divide the input dim K = {K} "
            f"(K is H for w13 and I for w2)"
        )


@dataclass(frozen=True)
class Fp8W8A8(QuantSpec):
    """fp8 e4m3 weights and activations.

    weight_scale: 'tensor' (one per expert), 'channel' (one per output row) or 'block'
    (`block_shape` = [128 rows, 128 cols], DeepSeek-V3; partial edge blocks allowed).
    activation_scheme: one of ACT_SCHEMES; None picks the usual partner of weight_scale
    (tensor -> dynamic_tensor, channel -> token, block -> token_group).
    A checkpoint's name for the scale (DeepSeek-V3's `weight_scale_inv`, a multiplier despite
    its name) is the loader's concern (`moekit.quant.loaders`), not the format's.
    """

    name: ClassVar[str] = "fp8_w8a8"
    data_dtype: ClassVar[torch.dtype] = FP8_DTYPE

    weight_scale: str = "block"
    block_shape: tuple[int, int] = (128, 128)
    activation_scheme: str | None = None

    def __post_init__(self) -> None:
        _choice(self.name, "weight_scale", self.weight_scale, FP8_WEIGHT_SCALES)
        object.__setattr__(self, "block_shape", tuple(self.block_shape))
        _choice(self.name, "block_shape", self.block_shape, FP8_BLOCK_SHAPES)
        if self.activation_scheme is None:
            default = {"tensor": "dynamic_tensor", "channel": "token", "block": "token_group"}
            object.__setattr__(self, "activation_scheme", default[self.weight_scale])
        _choice(self.name, "activation_scheme", self.activation_scheme, ACT_SCHEMES)

    @property
    def act_scheme(self) -> str:
        return self.activation_scheme

    @property
    def act_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    @property
    def act_group_size(self) -> int | None:
        return ACT_GROUP_SIZES[0] if self.activation_scheme == "token_group" else None

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        if self.weight_scale == "tensor":
            return ()
        if self.weight_scale == "channel":
            return (N,)
        bn, bk = self.block_shape
        return (math.ceil(N / bn), math.ceil(K / bk))


@dataclass(frozen=True)
class Int8W8A8(QuantSpec):
    """int8 weights with one scale per output row; activations int8 per token (dynamic)."""

    name: ClassVar[str] = "int8_w8a8"
    data_dtype: ClassVar[torch.dtype] = torch.int8

    @property
    def act_scheme(self) -> str:
        return "token"

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.int8

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N,)


@dataclass(frozen=True)
class Int8W8A16(QuantSpec):
    """int8 weights with one scale per output row; activations stay bf16/fp16 (weight-only)."""

    name: ClassVar[str] = "int8_w8a16"
    data_dtype: ClassVar[torch.dtype] = torch.int8

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N,)


@dataclass(frozen=True)
class Int4W4A16(QuantSpec):
    """int4 weights, one scale (and zero point unless `symmetric`) per `group_size` values of K;
    weight-only. Values are unsigned nibbles 0..15: w = (q - zero) * scale, zero = 8 when
    symmetric. `scale_dtype`: float32, bfloat16 or float16 (GPTQ/AWQ checkpoints: float16)."""

    name: ClassVar[str] = "int4_w4a16"
    data_dtype: ClassVar[torch.dtype] = torch.uint8
    pack_factor: ClassVar[int] = 2

    group_size: int = 128
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.bfloat16  # overrides the base property with a field

    def __post_init__(self) -> None:
        _choice(self.name, "group_size", self.group_size, INT4_GROUP_SIZES)
        _choice(self.name, "symmetric", self.symmetric, (True, False))
        _choice(self.name, "scale_dtype", self.scale_dtype, SCALE_DTYPES)

    @property
    def has_zero(self) -> bool:
        return not self.symmetric

    def check_k(self, N: int, K: int, what: str = "weight") -> None:
        _divides(self.name, "group_size", self.group_size, K, what)

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N, K // self.group_size)


@dataclass(frozen=True)
class MXFP4(QuantSpec):
    """OCP MX fp4: e2m1 values with one e8m0 (power of two) scale per 32 values of K;
    weight-only (bf16 activations; Hopper has no fp4 tensor cores)."""

    name: ClassVar[str] = "mxfp4"
    data_dtype: ClassVar[torch.dtype] = torch.uint8
    pack_factor: ClassVar[int] = 2
    group_size: ClassVar[int] = 32

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8

    def check_k(self, N: int, K: int, what: str = "weight") -> None:
        _divides(self.name, "group size", self.group_size, K, what)

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N, K // self.group_size)


@dataclass(frozen=True)
class NVFP4(QuantSpec):
    """NVIDIA fp4: e2m1 values, one e4m3 scale per 16 values of K, and a float32 global scale
    per matrix: w = e2m1 * float(scale_e4m3) * global_scale. Weight-only here."""

    name: ClassVar[str] = "nvfp4"
    data_dtype: ClassVar[torch.dtype] = torch.uint8
    pack_factor: ClassVar[int] = 2
    group_size: ClassVar[int] = 16

    @property
    def scale_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    @property
    def has_global_scale(self) -> bool:
        return True

    def check_k(self, N: int, K: int, what: str = "weight") -> None:
        _divides(self.name, "group size", self.group_size, K, what)

    def scale_shape(self, N: int, K: int) -> tuple[int, ...]:
        return (N, K // self.group_size)


SPECS: dict[str, type[QuantSpec]] = {
    cls.name: cls for cls in (Fp8W8A8, Int8W8A8, Int8W8A16, Int4W4A16, MXFP4, NVFP4)
}
# Every weight format name, 'unquantized' first (the same tuple as config.WEIGHT_FORMATS).
FORMATS: tuple[str, ...] = ("unquantized", *SPECS)
assert set(FORMATS) == set(WEIGHT_FORMATS), "quant.SPECS and config.WEIGHT_FORMATS disagree"


def _parse_value(fmt: str, key: str, text: str, default: object) -> object:
    """One `key=text` of a format string, typed like the parameter's default."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, tuple):  # block_shape: 128x128
            return tuple(int(v) for v in text.split("x"))
        if isinstance(default, torch.dtype):
            dtype = getattr(torch, text, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError
            return dtype
    except ValueError:
        raise ConfigError(
            f"--quantization {fmt}: {key}={text!r} is not a {type(default).__name__}"
            + (" (write it as 128x128)" if isinstance(default, tuple) else "")
        ) from None
    return None if text == "none" else text


def parse_format(text: str) -> tuple[str, dict]:
    """'name' or 'name:key=value,key=value' (the --quantization syntax, e.g.
    'fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor') -> (name, parameters typed
    like the spec's fields). Unknown names and parameters raise ConfigError naming the allowed."""
    name, _, rest = text.partition(":")
    if name not in SPECS:
        if name == "unquantized" and not rest:
            return name, {}
        raise ConfigError(
            f"--quantization: unknown weight format {name!r}; allowed: {', '.join(FORMATS)} "
            "(with parameters: NAME:key=value,...)"
        )
    defaults = {f.name: getattr(SPECS[name](), f.name) for f in fields(SPECS[name])}
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in defaults:
            allowed = ", ".join(defaults) or "none"
            raise ConfigError(
                f"--quantization {text}: {item!r} is not key=value of a {name} parameter; "
                f"allowed: {allowed}"
            )
        params[key] = _parse_value(text, key, value, defaults[key])
    return name, params


def format_text(spec: QuantSpec | None) -> str:
    """The --quantization string of a spec: its name, then the fewest parameters that give it
    ('fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor')."""
    if spec is None:
        return "unquantized"
    cls = type(spec)
    default = cls()
    params = {f.name: getattr(spec, f.name) for f in fields(spec)
              if getattr(spec, f.name) != getattr(default, f.name)}  # fmt: skip
    for key in list(params):  # drop what follows from the rest (fp8's activation default)
        if cls(**{k: v for k, v in params.items() if k != key}) == spec:
            del params[key]

    def text(value) -> str:
        if isinstance(value, tuple):
            return "x".join(map(str, value))
        if isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")
        return str(value).lower() if isinstance(value, bool) else str(value)

    items = ",".join(f"{k}={text(v)}" for k, v in params.items())
    return spec.name + (":" + items if items else "")


def make_spec(fmt: str | QuantSpec | None, **params) -> QuantSpec | None:
    """The spec for a format name (with optional parameters, as keywords or in the
    --quantization syntax 'name:key=value,...') or a spec passed through; None for
    'unquantized' / None. Unknown names raise ConfigError listing FORMATS."""
    if isinstance(fmt, QuantSpec):
        if params:
            raise ConfigError(f"{fmt.name}: parameters {sorted(params)} given with a spec object")
        return fmt
    if isinstance(fmt, str) and ":" in fmt:
        name, parsed = parse_format(fmt)
        if params:
            raise ConfigError(f"{fmt}: parameters {sorted(params)} given with a format string")
        return make_spec(name, **parsed)
    if fmt is None or fmt == "unquantized":
        if params:
            raise ConfigError(f"unquantized weights take no parameters, got {sorted(params)}")
        return None
    if fmt not in SPECS:
        raise ConfigError(
            f"--quantization: unknown weight format {fmt!r}; allowed: {', '.join(FORMATS)}"
        )
    cls = SPECS[fmt]
    known = {f.name for f in fields(cls)}
    unknown = set(params) - known
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise ConfigError(f"{fmt}: unknown parameter(s) {sorted(unknown)}; allowed: {allowed}")
    return cls(**params)


def format_name(fmt: str | QuantSpec | None) -> str:
    """The format name of a spec / name / --quantization string / None ('unquantized')."""
    if isinstance(fmt, QuantSpec):
        return fmt.name
    return "unquantized" if fmt is None else fmt.partition(":")[0]

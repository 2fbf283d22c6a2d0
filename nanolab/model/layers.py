"""The layers of a Llama decoder besides attention: `Linear`, `RMSNorm`, rotary embedding and the
SwiGLU `MLP`.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from nanolab.kernels import INTERPRETED
from nanolab.kernels.elementwise import rope_, silu_mul, silu_mul_op
from nanolab.kernels.gemv import fp8_linear, step_linear
from nanolab.model.config import ModelConfig
from nanolab.model.parallel import TensorParallel
from nanolab.model.quant import quantize_fp8


@torch.library.custom_op("nanolab::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear` as one operator inductor does not look into: the matmul stays the library's
    (cuBLAS on a GPU) at every batch, where inductor would lower a one-row matmul into a reduction
    of its own and tune it."""
    return F.linear(x, weight)


@linear_op.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# Prepacked `Linear`s by their weight's storage (`_weight_key`), so a compiled graph can reach a
# module's oneDNN weight: the blocked tensor is of a layout dynamo cannot fake, so
# `packed_linear_op` takes the plain weight, a graph input like any parameter, and looks the packed
# one up by it when it runs. Nothing model-specific is baked into the graph, so models of one
# architecture share their compiled graphs.
_PACKED: weakref.WeakValueDictionary[tuple[int, ...], Linear] = weakref.WeakValueDictionary()


def _weight_key(weight: torch.Tensor) -> tuple[int, ...]:
    return (weight.data_ptr(), *weight.shape)


# Defined through `torch.library.Library` rather than `custom_op`, whose Python wrapper costs
# microseconds a call: a step calls it for every matmul.
_lib = torch.library.Library("nanolab", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor weight) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out] through the oneDNN copy `Linear.prepack` made of `weight` [out, in]."""
    key = _weight_key(weight)
    module = _PACKED.get(key)
    if module is None or module.packed is None or _weight_key(module.weight) != key:
        raise RuntimeError(f"packed_linear: no prepacked copy of this weight {tuple(weight.shape)} "
                           "(Linear.prepack() was not called on it, or was undone)")
    return torch.ops.mkldnn._linear_pointwise(x, module.packed, None, "none", [], "")


_lib.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("nanolab::packed_linear")
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


packed_linear_op = torch.ops.nanolab.packed_linear


class Linear(nn.Linear):
    """`nn.Linear` without bias that can run through oneDNN on the CPU, or stay cuBLAS's under
    inductor.

    After `prepack()`, the weight is also held reordered into oneDNN's blocked layout (the
    path inductor's CPU freezing takes) and the matmul goes through oneDNN, eagerly or as one
    operator in a compiled graph (`packed_linear_op`): MKL's GEMV, which `F.linear` uses for a
    single decode row, keeps to one core. The weight is packed for any number of rows. The packed
    copy doubles the weights' memory, which a CPU box has to spare.

    With `opaque`, a compiled forward calls the matmul as one operator (`linear_op`), so inductor
    neither lowers nor fuses it. With `step_kernel` (set by `runner.compile_decode` where the step
    has PDL), a compiled forward of more than one row calls `kernels.gemv.step_linear`, which runs
    the Triton GEMV up to its row limit and `F.linear` past it.

    On the CPU, a compiled forward of one row (unless `opaque`) writes the matmul as a product and
    a sum, which inductor lowers into its own reduction, vectorised and spread over the cores, as it
    lowers a one-row matmul on a GPU; it reads the weight faster than the packed matmul at one row,
    and slower at more. The packed copy serves every other case: more rows, and the eager forward.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.packed: torch.Tensor | None = None
        self.opaque = False
        self.step_kernel = False
        self.qweight: torch.Tensor | None = None  # [out, in] float8_e4m3fn, after `quantize_fp8_`
        self.scale: torch.Tensor | None = None  # [out] fp32

    def quantize_fp8_(self) -> None:
        """Hold the weight as e4m3 with a scale per output row (`model.quant`) in place of the
        weight itself, which is dropped. The forward is `kernels.gemv.fp8_linear`: on CUDA the fp8
        GEMV for a decode step's few rows and a tiled W8A16 matmul for more, both reading the
        bytes; on the CPU the weight widened to the activations' dtype."""
        if self.packed is not None:
            raise ValueError("a prepacked Linear keeps its weight: quantize before prepack()")
        self.qweight, self.scale = quantize_fp8(self.weight.data)
        del self.weight
        self.register_parameter("weight", None)

    def prepack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        _PACKED[_weight_key(self.weight)] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return fp8_linear(x, self.qweight, self.scale)
        if not self.opaque and torch.compiler.is_compiling() and x.device.type == "cpu" \
                and math.prod(x.shape[:-1]) == 1:  # False, with no guard, for a dynamic batch (at least 2)
            # x [1, 1, in] * weight [out, in], summed over in: inductor fuses the two into one
            # reduction and never builds the product.
            return (x.unsqueeze(-2) * self.weight).sum(-1)
        if self.step_kernel and torch.compiler.is_compiling() and math.prod(x.shape[:-1]) != 1:
            # True, with no guard, for a symbolic batch (at least 2); batch 1 keeps inductor's reduction.
            return step_linear(x, self.weight)
        if self.packed is not None:
            if torch.compiler.is_compiling():
                return packed_linear_op(x, self.weight)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.opaque and torch.compiler.is_compiling():
            return linear_op(x, self.weight)
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with Llama 3's piecewise scaling when the
    config asks for it: long wavelengths are slowed by `factor`, short ones kept, and the band
    between is interpolated."""
    d = config.head_dim
    # fp32 throughout, as transformers computes it, so positions past 1,000 rotate identically.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(band, interpolated, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [rows, T] -> cos, sin [rows, T, 1, head_dim], computed once per forward and
    shared by every layer."""
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [rows, T, head_dim // 2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def eager_on_gpu(x: torch.Tensor) -> bool:
    """Whether x's forward runs eagerly on a GPU, where one Triton kernel beats a chain of torch
    ops (`kernels.elementwise`); under torch.compile inductor fuses the torch ops itself."""
    return x.is_cuda and not INTERPRETED and not torch.compiler.is_compiling()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, T, heads, head_dim], rotated in halves (the Hugging Face layout, whose Q and K
    rows are already permuted for it). Eagerly on a GPU, in place in one kernel (`rope_`)."""
    if eager_on_gpu(x):
        return rope_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        a, b = tp.intermediate(config) if tp else (0, config.intermediate_size)  # this rank's share
        # gate and up fused: [2 * intermediate, hidden]
        self.gate_up_proj = Linear(config.hidden_size, 2 * (b - a))
        self.down_proj = Linear(b - a, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if eager_on_gpu(gate_up):
            out = self.down_proj(silu_mul(gate_up))
        elif gate_up.is_cuda and not INTERPRETED and math.prod(gate_up.shape[:-1]) == 1:
            # compiled, one row: the activation [1, 1, inter] written once by its own kernel. Fused into
            # down's reduction, inductor recomputes it for every output channel, reading gate and up
            # hidden x inter times (`data/day65_fp8_profile_h200.csv`).
            out = self.down_proj(silu_mul_op(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return self.tp.all_reduce(out) if self.tp else out  # row-parallel: the ranks' partial sums

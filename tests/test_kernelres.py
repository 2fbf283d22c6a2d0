"""`lab.kernelres`: the varlen read's kernel compiled for sm_90 without a GPU, and cuobjdump's
resource line read back."""

from __future__ import annotations

import argparse

import pytest

from nanolab.lab import kernelres
from nanolab.lab.kernelres import VarlenLaunch, parse_usage, varlen_resources


def test_the_resource_line_is_read_and_a_missing_one_refused():
    line = "Function _varlen_group:\n REG:254 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:688 TEXTURE:0"
    assert parse_usage(line) == {"registers": 254, "stack_bytes": 0, "shared_static_bytes": 1024, "local_bytes": 8}
    with pytest.raises(ValueError, match="no resource usage"):
        parse_usage("cuobjdump: nothing")


def test_narrow_offsets_compile_without_spilling():
    """The engine's launch after a cached prefix, compiled for sm_90: narrow offsets spill nothing
    (what chapter 64c reads), and every row names its launch."""
    table = varlen_resources([VarlenLaunch(True, 8, 3)])
    (row,) = table.to_dict("records")
    assert (row["kernel"], row["narrow"], row["splits"], row["arch"]) == ("_varlen_group", True, 8, "sm_90")
    assert 0 < row["registers"] <= 255 and row["stack_bytes"] == 0 and row["local_bytes"] == 0


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="launches"):
        varlen_resources([])
    for arch in (9, 99999):  # not an architecture, or none Triton compiles for: refused before compiling
        with pytest.raises(ValueError, match="--arch"):
            kernelres.main(argparse.Namespace(arch=arch, kernels="varlen", prefix="never"))
    with pytest.raises(ValueError, match="--arch: 86 has no e4m3"):
        kernelres.main(argparse.Namespace(arch=86, kernels="gemv", prefix="never"))
    with pytest.raises(ValueError, match="--kernels"):
        kernelres.main(argparse.Namespace(arch=90, kernels="varlen,paged", prefix="never"))


def test_the_fp8_gemv_at_8_warps_compiles_without_spilling():
    """The fp8 decode GEMV at `step_config`'s tiles for Llama-3.2-1B's projections (the preset's
    shapes; no weights are made), at 8 warps: none spills, and each row names its tiles."""
    table = kernelres.gemv_resources(rows=(1,), warps=(8,))
    assert list(table.projection) == ["qkv", "o", "gate_up", "down"]
    assert (table.num_warps == 8).all() and (table.stack_bytes == 0).all() and (table.registers <= 255).all()
    assert table.set_index("projection").loc["down", "split_k"] > 1  # a deep weight in shares, as the engine cuts it
    with pytest.raises(ValueError, match="warps"):
        kernelres.gemv_resources(warps=(3,))
